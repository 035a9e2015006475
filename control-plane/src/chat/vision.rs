//! Images in a vision model's prompt. The chat template places one image token (or,
//! for a video, one video token) where each image part was; each is then replaced by
//! what the model's processor puts there for that picture — Idefics3's grid of tiles
//! with its row and column markers, LLaVA's run of image tokens — so that the prompt's
//! tokens, its length and its bill count every image token the worker will fill.
//!
//! A video is a run of two or more image parts with nothing between them, on a model
//! that takes video (SmolVLM2's `video_sampling`). It is prompted as SmolVLM2's
//! processor prompts one, frames at its sampling rate, and when the prompt does not fit
//! the context its frames are sampled uniformly down to the most that fit.

use crate::images::{Detail, LoadedImage, Visual};
use tessera_proto::vision::{Idefics3Geometry, Idefics3Markers, llava_next_tokens};
use tessera_proto::worker as pb;

/// The model's way with images, from its worker's card.
#[derive(Debug, Clone, PartialEq)]
pub struct Vision {
    card: pb::VisionCard,
}

impl Vision {
    pub fn new(card: pb::VisionCard) -> Self {
        Self { card }
    }

    /// The token the template writes for an image.
    pub fn image_token(&self) -> &str {
        &self.card.image_token
    }

    /// The token the template writes for a video (SmolVLM2's), where the model takes video.
    pub fn video_token(&self) -> Option<&'static str> {
        match &self.card.family {
            Some(pb::vision_card::Family::Idefics3(i)) if i.video_max_frames > 0 => Some("<video>"),
            _ => None,
        }
    }

    /// Whether runs of image parts are videos: the catalog entry takes video and the
    /// weights have a video prompt.
    pub fn takes_video(&self, caps: &crate::catalog::Capabilities) -> bool {
        caps.video_input && self.video_token().is_some()
    }

    /// Frames a video may have before any sampling for the context.
    pub fn max_frames(&self) -> usize {
        match &self.card.family {
            Some(pb::vision_card::Family::Idefics3(i)) => i.video_max_frames as usize,
            _ => 0,
        }
    }

    /// The text standing for a `width` × `height` image.
    pub fn image_text(&self, width: u32, height: u32, detail: Detail) -> String {
        use pb::vision_card::Family;
        match &self.card.family {
            Some(Family::Idefics3(i)) => {
                let g = geometry(i);
                g.placeholder(g.grid(width, height, detail.split()), &markers(i, &self.card))
            }
            Some(Family::Llava(l)) => self.card.image_token.repeat(llava_tokens(l, width, height)),
            None => String::new(),
        }
    }

    /// Image tokens (the encoder's rows) a `width` × `height` image takes, marker
    /// tokens aside: what its input price is charged on, beside its text.
    pub fn image_tokens(&self, width: u32, height: u32, detail: Detail) -> usize {
        use pb::vision_card::Family;
        match &self.card.family {
            Some(Family::Idefics3(i)) => {
                let (rows, cols) = geometry(i).grid(width, height, detail.split());
                (rows * cols + 1) as usize * i.image_seq_len as usize
            }
            Some(Family::Llava(l)) => llava_tokens(l, width, height),
            None => 0,
        }
    }

    /// SmolVLM2's text for a video of `frames` frames taken at `times` seconds.
    fn video_text(&self, times: &[usize]) -> String {
        let Some(pb::vision_card::Family::Idefics3(i)) = &self.card.family else { return String::new() };
        let g = geometry(i);
        let fps = if i.video_fps > 0.0 { i.video_fps } else { 1.0 };
        // Duration: the frames sent at the sampling rate (HF: the video's length).
        let duration = ((times.last().map_or(0, |t| t + 1)) as f64 / fps) as u64;
        let mut text = format!(
            "You are provided the following series of {} frames from a {}:{:02}:{:02} video.\n",
            number_words(times.len()),
            duration / 3600,
            duration / 60 % 60,
            duration % 60
        );
        for &t in times {
            let second = (t as f64 / fps) as u64;
            text.push_str(&format!("\nFrame from {:02}:{:02}:", second / 60, second % 60));
            text.push_str(&g.placeholder((0, 0), &markers(i, &self.card)));
        }
        text.push_str("\n\n");
        text
    }

    /// `rendered` with each image and video token replaced, in order, by its visual's
    /// text; `keep[v]` are the frames of video `v` that stay (indices into its frames).
    pub fn expand(&self, rendered: &str, visuals: &[Visual], keep: &[Vec<usize>]) -> Result<Expanded, ExpandError> {
        let image = self.card.image_token.as_str();
        let video = self.video_token();
        let mut out = String::with_capacity(rendered.len());
        let mut inputs = Vec::new();
        let mut tokens = Vec::new();
        let mut rest = rendered;
        let mut videos = 0;
        for visual in visuals {
            let token = match visual {
                Visual::Image { .. } => image,
                Visual::Video { .. } => video.ok_or(ExpandError::TemplateDrops)?,
            };
            let at = rest.find(token).ok_or(ExpandError::TemplateDrops)?;
            out.push_str(&rest[..at]);
            rest = &rest[at + token.len()..];
            match visual {
                Visual::Image { image, detail } => {
                    out.push_str(&self.image_text(image.width, image.height, *detail));
                    inputs.push(input(image, detail.split(), false));
                    tokens.push(self.image_tokens(image.width, image.height, *detail));
                }
                Visual::Video { frames } => {
                    let kept = keep.get(videos).cloned().unwrap_or_else(|| (0..frames.len()).collect());
                    videos += 1;
                    out.push_str(&self.video_text(&kept));
                    inputs.extend(kept.iter().map(|&f| input(&frames[f], false, true)));
                    // A frame is one tile, never split.
                    tokens.extend(kept.iter().map(|_| self.image_tokens(1, 1, Detail::Low)));
                }
            }
        }
        if rest.contains(image) || video.is_some_and(|v| rest.contains(v)) {
            return Err(ExpandError::TextHasToken);
        }
        out.push_str(rest);
        Ok(Expanded { text: out, images: inputs, tokens })
    }

    /// The image token's id, which the worker fills.
    pub fn image_token_id(&self) -> u32 {
        self.card.image_token_id
    }
}

/// A prompt with its visuals' placeholders in place.
#[derive(Debug, Clone)]
pub struct Expanded {
    pub text: String,
    /// As the worker takes them, in placeholder order.
    pub images: Vec<pb::ImageInput>,
    /// Image tokens each of `images` takes.
    pub tokens: Vec<usize>,
}

/// Why a prompt's placeholders do not match the request's visuals. Either way it is the
/// request's doing: its text spells the token, or its images sit where the model's
/// template shows none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ExpandError {
    /// The prompt has image tokens no image part put there: the request's own text
    /// spells the token.
    #[error("the prompt has more image tokens than the request has images")]
    TextHasToken,
    /// The template showed fewer images than the request has: it leaves out the
    /// messages (or roles) some of them are in.
    #[error("the chat template placed fewer image tokens than the request has images")]
    TemplateDrops,
}

fn input(image: &LoadedImage, split: bool, frame: bool) -> pb::ImageInput {
    pb::ImageInput { data: image.bytes.clone(), sha256: image.sha256.to_vec(), split, frame }
}

fn geometry(i: &pb::Idefics3Vision) -> Idefics3Geometry {
    Idefics3Geometry { longest_edge: i.longest_edge, tile: i.tile, image_seq_len: i.image_seq_len as usize }
}

fn markers(i: &pb::Idefics3Vision, card: &pb::VisionCard) -> Idefics3Markers {
    Idefics3Markers {
        around: i.fake_image_token.clone(),
        image: card.image_token.clone(),
        global: i.global_image_token.clone(),
    }
}

fn llava_tokens(l: &pb::LlavaVision, width: u32, height: u32) -> usize {
    let pinpoints: Vec<(u32, u32)> = l.pinpoints.chunks_exact(2).map(|p| (p[0], p[1])).collect();
    match pinpoints.is_empty() {
        true => l.tile_tokens as usize,
        false => llava_next_tokens(height, width, &pinpoints, l.tile, l.grid as usize).unwrap_or(0),
    }
}

/// `frames` chosen evenly from `n`, first and last kept (numpy's `linspace(0, n - 1,
/// frames)` truncated, as SmolVLM2's sampler takes them), without repeats.
pub fn sample(n: usize, frames: usize) -> Vec<usize> {
    if frames >= n {
        return (0..n).collect();
    }
    if frames <= 1 {
        return vec![0];
    }
    let mut out: Vec<usize> = (0..frames).map(|i| (i as f64 * (n - 1) as f64 / (frames - 1) as f64) as usize).collect();
    out.dedup();
    out
}

/// A count in English words, as num2words writes it (SmolVLM2's video prompt).
fn number_words(n: usize) -> String {
    const ONES: [&str; 20] = [
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
    ];
    const TENS: [&str; 10] = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"];
    match n {
        0..20 => ONES[n].to_string(),
        20..100 if n.is_multiple_of(10) => TENS[n / 10].to_string(),
        20..100 => format!("{}-{}", TENS[n / 10], ONES[n % 10]),
        100..1000 if n.is_multiple_of(100) => format!("{} hundred", ONES[n / 100]),
        100..1000 => format!("{} hundred and {}", ONES[n / 100], number_words(n % 100)),
        _ => n.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smol() -> Vision {
        Vision::new(pb::VisionCard {
            image_token: "<image>".into(),
            image_token_id: 4,
            family: Some(pb::vision_card::Family::Idefics3(pb::Idefics3Vision {
                longest_edge: 96,
                tile: 32,
                image_seq_len: 4,
                fake_image_token: "<fake_token_around_image>".into(),
                global_image_token: "<global-img>".into(),
                video_max_frames: 8,
                video_fps: 1.0,
            })),
        })
    }

    fn loaded(width: u32, height: u32, byte: u8) -> LoadedImage {
        LoadedImage { bytes: vec![byte], sha256: [byte; 32], format: "PNG", width, height }
    }

    #[test]
    fn image_tokens_follow_size_and_detail() {
        let v = smol();
        // 50 x 30: scaled to 96 x 58, grown to 96 x 64: 2 rows of 3 tiles and the global one.
        assert_eq!(v.image_tokens(50, 30, Detail::Auto), 7 * 4);
        assert_eq!(v.image_tokens(50, 30, Detail::Low), 4);
        assert!(v.image_text(50, 30, Detail::High).contains("<row_2_col_3>"));
        let llava = Vision::new(pb::VisionCard {
            image_token: "<image>".into(),
            image_token_id: 4,
            family: Some(pb::vision_card::Family::Llava(pb::LlavaVision {
                tile_tokens: 16,
                tile: 32,
                grid: 4,
                pinpoints: vec![32, 64, 64, 32, 64, 64, 96, 32, 32, 96],
            })),
        });
        assert_eq!(llava.image_tokens(50, 30, Detail::Low), 44, "NeXT ignores detail");
        assert_eq!(llava.image_text(50, 30, Detail::Auto), "<image>".repeat(44));
    }

    #[test]
    fn expansion_replaces_each_token_in_order_and_counts_must_agree() {
        let v = smol();
        let visuals = [
            Visual::Image { image: loaded(50, 30, 1), detail: Detail::Low },
            Visual::Video { frames: (0..4).map(|i| loaded(40, 24, 10 + i)).collect() },
        ];
        let e = v.expand("A<image>B<video>C", &visuals, &[vec![0, 3]]).unwrap();
        let (text, inputs) = (e.text, e.images);
        assert_eq!(e.tokens, [4, 4, 4]);
        assert!(text.starts_with("A<fake_token_around_image><global-img><image>"), "{text}");
        assert!(text.contains("series of two frames from a 0:00:04 video.\n\nFrame from 00:00:"), "{text}");
        assert!(text.contains("\nFrame from 00:03:") && text.ends_with("\n\nC"), "{text}");
        assert_eq!(inputs.len(), 3);
        assert_eq!((inputs[0].split, inputs[1].frame, inputs[2].sha256[0]), (false, true, 13));
        assert_eq!(v.expand("A B", &visuals, &[]).unwrap_err(), ExpandError::TemplateDrops);
        assert_eq!(v.expand("<image><image>", &visuals[..1], &[]).unwrap_err(), ExpandError::TextHasToken);
    }

    #[test]
    fn frames_are_sampled_evenly_keeping_both_ends() {
        assert_eq!(sample(10, 4), [0, 3, 6, 9]);
        assert_eq!(sample(5, 8), [0, 1, 2, 3, 4]);
        assert_eq!(sample(7, 1), [0]);
        assert_eq!(number_words(4), "four");
        assert_eq!(number_words(64), "sixty-four");
    }
}
