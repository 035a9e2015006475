//! Where a prompt's image features go: its placeholder tokens, in order, take the
//! features of its images, in order (the reference's `masked_scatter`), and a prefill
//! chunk takes the part that falls inside it, wherever the chunk boundary cuts an image.

use super::Features;
use crate::model::Embeds;
use std::sync::Arc;
use tessera_proto::block_hash::{ImageSpan, image_spans};

/// A run of consecutive placeholder tokens and the feature row its first one takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub at: usize,
    pub len: usize,
    pub first_row: usize,
}

/// Why a prompt's placeholders and its images' features do not belong together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("the prompt has {tokens} image tokens for {rows} rows of image features")]
    Count { tokens: usize, rows: usize },
    #[error("an image's features are {floats} floats for {tokens} rows of {hidden}")]
    Shape { floats: usize, tokens: usize, hidden: usize },
    #[error("image tokens and images disagree")]
    Spans,
}

/// The runs of `image_token` in `ids`, given `rows` feature rows to fill them: an error
/// when the counts differ (the prompt and the images do not belong together).
pub fn runs(ids: &[u32], image_token: u32, rows: usize) -> Result<Vec<Run>, PlacementError> {
    let mut out: Vec<Run> = Vec::new();
    let mut filled = 0;
    for (i, &t) in ids.iter().enumerate() {
        if t != image_token {
            continue;
        }
        match out.last_mut() {
            Some(r) if r.at + r.len == i => r.len += 1,
            _ => out.push(Run { at: i, len: 1, first_row: filled }),
        }
        filled += 1;
    }
    if filled != rows {
        return Err(PlacementError::Count { tokens: filled, rows });
    }
    Ok(out)
}

/// The embeddings that replace tokens `start..end` of the prompt: for each run that
/// overlaps the range, the rows of its overlap (`hidden` floats each), placed relative
/// to `start`.
pub fn chunk<'a>(runs: &[Run], rows: &'a [f32], hidden: usize, start: usize, end: usize) -> Vec<Embeds<'a>> {
    runs.iter()
        .filter_map(|r| {
            let (from, to) = (r.at.max(start), (r.at + r.len).min(end));
            (from < to).then(|| {
                let first = r.first_row + from - r.at;
                Embeds { at: from - start, rows: &rows[first * hidden..(first + to - from) * hidden] }
            })
        })
        .collect()
}

/// A prompt's encoded images laid over its placeholder tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacedImages {
    runs: Vec<Run>,
    rows: Vec<f32>,
    hidden: usize,
    /// Each image's tokens (first to last placeholder) and content hash: the prefix
    /// cache keys the blocks holding them by it.
    pub spans: Vec<ImageSpan>,
}

impl PlacedImages {
    /// `images` (content hash, features; in prompt order) over `prompt`'s runs of
    /// `image_token`: an error when their rows and the placeholders differ in number.
    pub fn new(
        prompt: &[u32],
        image_token: u32,
        images: &[([u8; 32], Arc<Features>)],
        hidden: usize,
    ) -> Result<Self, PlacementError> {
        let total: usize = images.iter().map(|(_, f)| f.tokens).sum();
        let runs = runs(prompt, image_token, total)?;
        let mut rows = Vec::with_capacity(total * hidden);
        for (_, f) in images {
            if f.tokens == 0 || f.rows.len() != f.tokens * hidden {
                return Err(PlacementError::Shape { floats: f.rows.len(), tokens: f.tokens, hidden });
            }
            rows.extend_from_slice(&f.rows);
        }
        // The same spans the control plane routes by.
        let counted: Vec<(usize, [u8; 32])> = images.iter().map(|(h, f)| (f.tokens, *h)).collect();
        let spans = image_spans(prompt, image_token, &counted).ok_or(PlacementError::Spans)?;
        Ok(Self { runs, rows, hidden, spans })
    }

    /// The embeddings replacing tokens `start..end` of the prompt.
    pub fn chunk(&self, start: usize, end: usize) -> Vec<Embeds<'_>> {
        chunk(&self.runs, &self.rows, self.hidden, start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_take_rows_in_order_and_chunks_cut_them() {
        // Tokens 9 are placeholders: two runs, of 3 and 2.
        let ids = [1, 9, 9, 9, 2, 3, 9, 9, 4];
        let r = runs(&ids, 9, 5).unwrap();
        assert_eq!(r, [Run { at: 1, len: 3, first_row: 0 }, Run { at: 6, len: 2, first_row: 3 }]);
        assert_eq!(runs(&ids, 9, 4).unwrap_err(), PlacementError::Count { tokens: 5, rows: 4 });
        let rows: Vec<f32> = (0..10).map(|v| v as f32).collect(); // 5 rows of 2
        // A chunk from token 2 to 7 cuts both runs: rows 1-2 at 0, row 3 at 4.
        let c = chunk(&r, &rows, 2, 2, 7);
        assert_eq!(c.len(), 2);
        assert_eq!((c[0].at, c[0].rows), (0, &[2.0, 3.0, 4.0, 5.0][..]));
        assert_eq!((c[1].at, c[1].rows), (4, &[6.0, 7.0][..]));
        assert!(chunk(&r, &rows, 2, 4, 6).is_empty());
    }

    #[test]
    fn each_image_spans_its_own_placeholders() {
        // Image A has 4 rows: the run of 3 and the first of the next; image B the last.
        let ids = [1, 9, 9, 9, 2, 3, 9, 9, 4];
        let feats = |n: usize| Arc::new(Features { rows: vec![0.5; n * 2], tokens: n });
        let placed = PlacedImages::new(&ids, 9, &[([1; 32], feats(4)), ([2; 32], feats(1))], 2).unwrap();
        assert_eq!((placed.spans[0].start, placed.spans[0].end), (1, 7));
        assert_eq!((placed.spans[1].start, placed.spans[1].end), (7, 8));
        assert!(PlacedImages::new(&ids, 9, &[([1; 32], feats(4))], 2).is_err());
    }
}
