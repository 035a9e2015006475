//! What both processes must agree on about an image for a vision model, from its size
//! alone: how the Idefics3 / SmolVLM processor cuts it into tiles, and the placeholder
//! text the prompt carries for it (for the control plane to render and count, and the
//! worker to fill with the encoder's output, tile by tile), and LLaVA-NeXT's choice of
//! resolution.

/// The Idefics3 / SmolVLM processor's geometry (`preprocessor_config.json`, and the
/// model's `image_seq_len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Idefics3Geometry {
    /// `size.longest_edge`: the image's longest side after the first resize.
    pub longest_edge: u32,
    /// `max_image_size.longest_edge`: the encoder's square tile.
    pub tile: u32,
    /// Image tokens a tile becomes.
    pub image_seq_len: usize,
}

/// The processor's marker tokens, as the tokenizer spells them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Idefics3Markers {
    pub around: String,
    pub image: String,
    pub global: String,
}

impl Default for Idefics3Markers {
    fn default() -> Self {
        Self { around: "<fake_token_around_image>".into(), image: "<image>".into(), global: "<global-img>".into() }
    }
}

impl Idefics3Geometry {
    /// The size after the first resize: the longest side set to `longest_edge` (the
    /// other in proportion, truncated, then made even; at least 1), then kept within
    /// 4096 a side — as the reference computes it, upscaling small images too.
    pub fn scaled(&self, width: u32, height: u32) -> (u32, u32) {
        const UPPER: u32 = 4096;
        let longest = self.longest_edge;
        let aspect = width as f64 / height as f64;
        let (mut w, mut h) = if width >= height {
            let h = (longest as f64 / aspect) as u32;
            (longest, h + h % 2)
        } else {
            let w = (longest as f64 * aspect) as u32;
            (w + w % 2, longest)
        };
        (w, h) = (w.max(1), h.max(1));
        let aspect = w as f64 / h as f64;
        if w >= h && w > UPPER {
            (w, h) = (UPPER, (UPPER as f64 / aspect) as u32);
        } else if h > w && h > UPPER {
            (w, h) = ((UPPER as f64 * aspect) as u32, UPPER);
        }
        (w.max(1), h.max(1))
    }

    /// The scaled size grown to whole tiles along its longest side, the other side in
    /// proportion, rounded up to whole tiles.
    pub fn grown(&self, width: u32, height: u32) -> (u32, u32) {
        let tile = self.tile as f64;
        let aspect = width as f64 / height as f64;
        let up = |x: f64| (x / tile).ceil() as u32 * self.tile;
        if width >= height {
            let w = up(width as f64);
            (w, up(((w as f64 / aspect) as u32) as f64))
        } else {
            let h = up(height as f64);
            (up(((h as f64 * aspect) as u32) as f64), h)
        }
    }

    /// The tile grid of a `width` × `height` image: (rows, columns), 0 × 0 when it is
    /// one tile (always, without splitting).
    pub fn grid(&self, width: u32, height: u32, split: bool) -> (u32, u32) {
        if !split {
            return (0, 0);
        }
        let (w, h) = self.scaled(width, height);
        let (w, h) = self.grown(w, h);
        let m = self.tile;
        // `grown` gives whole tiles.
        if w <= m && h <= m { (0, 0) } else { (h / m, w / m) }
    }

    /// The text standing for an image of `rows` × `cols` tiles: per tile its marker,
    /// position and image tokens, a line a row, then the global tile.
    pub fn placeholder(&self, (rows, cols): (u32, u32), m: &Idefics3Markers) -> String {
        let tokens = m.image.repeat(self.image_seq_len);
        let global = format!("{}{}{tokens}{}", m.around, m.global, m.around);
        if rows == 0 && cols == 0 {
            return global;
        }
        let mut text = String::new();
        for r in 1..=rows {
            for c in 1..=cols {
                text.push_str(&format!("{}<row_{r}_col_{c}>{tokens}", m.around));
            }
            text.push('\n');
        }
        format!("{text}\n{global}")
    }
}

/// LLaVA-NeXT's choice among `pinpoints` (each `(height, width)`) for an image of
/// `height` × `width`: the one that keeps the most of its pixels when it is fitted
/// inside, then the one that wastes least; the first of equals.
pub fn best_resolution(height: u32, width: u32, pinpoints: &[(u32, u32)]) -> Option<(u32, u32)> {
    let (h0, w0) = (height as f64, width as f64);
    let mut best: Option<((u32, u32), u64, u64)> = None;
    for &(h, w) in pinpoints {
        let scale = (w as f64 / w0).min(h as f64 / h0);
        let (dw, dh) = ((w0 * scale) as u64, (h0 * scale) as u64);
        let effective = (dw * dh).min(width as u64 * height as u64);
        let wasted = (w as u64 * h as u64).saturating_sub(effective);
        let better = match best {
            None => true,
            Some((_, e, waste)) => effective > e || (effective == e && wasted < waste),
        };
        if better {
            best = Some(((h, w), effective, wasted));
        }
    }
    best.map(|(r, ..)| r)
}

/// The size (height, width) an image of `height` × `width` is resized to inside
/// `target` (height, width): the tighter side fills it, the other in proportion,
/// rounded up (LLaVA-NeXT's `get_patch_output_size`).
pub fn fit_inside(height: u32, width: u32, (th, tw): (u32, u32)) -> (u32, u32) {
    let (sw, sh) = (tw as f64 / width as f64, th as f64 / height as f64);
    if sw < sh {
        (((height as f64 * sw).ceil() as u32).min(th), tw)
    } else {
        (th, ((width as f64 * sh).ceil() as u32).min(tw))
    }
}

/// LLaVA-NeXT's feature grid of an image of `height` × `width` fitted and padded into
/// a `cur_h` × `cur_w` grid: the rows and the columns that hold the image (the model's
/// `unpad_image`, its `round(·, 7)` included).
pub fn unpadded(
    height: u32,
    width: u32,
    cur_h: usize,
    cur_w: usize,
) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let (h, w) = (height as f64, width as f64);
    let round7 = |x: f64| ((x * 1e7).round() / 1e7) as usize;
    if w / h > cur_w as f64 / cur_h as f64 {
        let new_h = round7(h * (cur_w as f64 / w));
        let pad = cur_h.saturating_sub(new_h) / 2;
        (pad..cur_h - pad, 0..cur_w)
    } else {
        let new_w = round7(w * (cur_h as f64 / h));
        let pad = cur_w.saturating_sub(new_w) / 2;
        (0..cur_h, pad..cur_w - pad)
    }
}

/// The feature rows (and so `<image>` tokens) LLaVA-NeXT gives an image of `height` ×
/// `width`: the squashed whole image's `grid`² patches, then the best resolution's
/// patch grid with its padding cut away, each row ended by a newline row. `tile` is the
/// encoder's image size and `grid` its patches a side.
pub fn llava_next_tokens(height: u32, width: u32, pinpoints: &[(u32, u32)], tile: u32, grid: usize) -> Option<usize> {
    let (bh, bw) = best_resolution(height, width, pinpoints)?;
    let (cur_h, cur_w) = ((bh / tile) as usize * grid, (bw / tile) as usize * grid);
    let (rows, cols) = unpadded(height, width, cur_h, cur_w);
    Some(grid * grid + rows.len() * (cols.len() + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llava_next_picks_the_resolution_the_reference_picks() {
        let pinpoints = [(336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)];
        // 480 x 640 (h x w) fits 672 x 672 best, a wide strip 336 x 1008, a 1:2 image 336 x 672.
        assert_eq!(best_resolution(480, 640, &pinpoints), Some((672, 672)));
        assert_eq!(best_resolution(300, 900, &pinpoints), Some((336, 1008)));
        assert_eq!(best_resolution(200, 400, &pinpoints), Some((336, 672)));
        assert_eq!(best_resolution(10, 10, &[]), None);
        assert_eq!(fit_inside(30, 50, (32, 64)), (32, 54));
        assert_eq!(fit_inside(50, 30, (32, 64)), (32, 20));
    }

    #[test]
    fn llava_next_counts_the_unpadded_grid_and_its_newlines() {
        let pinpoints = [(32, 64), (64, 32), (64, 64), (96, 32), (32, 96)];
        // 50 wide, 30 high: 32 x 64, a 4 x 8 patch grid of which columns 1..7 hold the image.
        assert_eq!(unpadded(30, 50, 4, 8), (0..4, 1..7));
        assert_eq!(llava_next_tokens(30, 50, &pinpoints, 32, 4), Some(16 + 4 * (6 + 1)));
        // Taller than the grid: rows cut instead.
        assert_eq!(unpadded(50, 30, 8, 4), (1..7, 0..4));
        // llava-v1.6 at 336 / 14: a 672 x 672 grid for a 480 x 640 image keeps 36 of 48 rows.
        let big = [(336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)];
        assert_eq!(llava_next_tokens(480, 640, &big, 336, 24), Some(576 + 36 * 49));
    }

    const G: Idefics3Geometry = Idefics3Geometry { longest_edge: 48, tile: 16, image_seq_len: 2 };

    #[test]
    fn sizes_and_grids_follow_the_reference_rules() {
        // The long side set to 48, the short truncated then made even (not below 1).
        assert_eq!(G.scaled(50, 30), (48, 28));
        assert_eq!(G.scaled(30, 50), (28, 48));
        assert_eq!(G.scaled(50, 1), (48, 1));
        let big = Idefics3Geometry { longest_edge: 8192, ..G };
        assert_eq!(big.scaled(9000, 100), (4096, 46));
        // Grown to whole 16-pixel tiles, then cut.
        assert_eq!(G.grown(48, 28), (48, 32));
        assert_eq!(G.grown(28, 48), (32, 48));
        assert_eq!(G.grid(50, 30, true), (2, 3));
        assert_eq!(G.grid(50, 30, false), (0, 0));
        assert_eq!(Idefics3Geometry { longest_edge: 16, ..G }.grid(50, 30, true), (0, 0));
    }

    #[test]
    fn placeholders_are_the_reference_processors_text() {
        // transformers' get_image_prompt_string(1, 2, 2, ...) and (0, 0, 2, ...).
        let m = Idefics3Markers::default();
        assert_eq!(
            G.placeholder((1, 2), &m),
            "<fake_token_around_image><row_1_col_1><image><image><fake_token_around_image><row_1_col_2><image><image>\
             \n\n<fake_token_around_image><global-img><image><image><fake_token_around_image>"
        );
        assert_eq!(
            G.placeholder((0, 0), &m),
            "<fake_token_around_image><global-img><image><image><fake_token_around_image>"
        );
    }
}
