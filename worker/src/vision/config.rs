//! A vision-language model directory's vision half, as its files describe it:
//! `config.json` (the tower, the connector, the image token) and the processor's
//! configuration (`preprocessor_config.json`, or the `image_processor` inside
//! `processor_config.json` as transformers 5 writes it). Fields a file leaves out take
//! the configuration classes' defaults, as transformers does.

use super::Values;
use super::idefics3::Idefics3Processor;
use super::llava::LlavaProcessor;
use super::resize::Filter;
use crate::loader::LoadError;
use serde_json::Value;
use std::path::Path;
use tessera_kernels::Gelu;
use tessera_proto::vision::{Idefics3Geometry, Idefics3Markers};
use tessera_proto::worker as pb;

/// Which vision transformer: they differ in a class token, a norm before the layers and
/// a bias on the patch projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TowerKind {
    /// OpenAI's CLIP: class token, `pre_layrnorm`, no patch bias.
    Clip,
    /// SigLIP (and Idefics3's variant of it): no class token, patch bias.
    Siglip,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TowerConfig {
    pub kind: TowerKind,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub image_size: usize,
    pub patch_size: usize,
    pub act: Gelu,
    pub layer_norm_eps: f32,
}

impl TowerConfig {
    /// Patches a side.
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Patches of one image.
    pub fn patches(&self) -> usize {
        self.grid() * self.grid()
    }

    /// Rows the tower runs per image: the patches, and CLIP's class token.
    pub fn seq_len(&self) -> usize {
        self.patches() + usize::from(self.kind == TowerKind::Clip)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }
}

/// How features leave the tower and become the decoder's rows.
#[derive(Debug, Clone, PartialEq)]
pub enum Connector {
    /// Idefics3 / SmolVLM: the last layer, `post_layernorm`, `scale_factor`² neighbouring
    /// patches folded into one row (pixel shuffle), one projection without bias.
    PixelShuffle { scale_factor: usize },
    /// LLaVA: the output of layer `layers` (no norm), each tile's first row (CLIP's
    /// class token) dropped by the "default" strategy, a two-layer MLP; NeXT also tiles
    /// images and ends each row of its feature grid with a newline.
    Mlp { layers: usize, drop_first: bool, act: Gelu, next: bool },
}

/// How a family's processor makes tiles.
#[derive(Debug, Clone, PartialEq)]
pub enum Processor {
    Idefics3 { processor: Idefics3Processor, markers: Idefics3Markers, video: Option<VideoSampling> },
    Llava(LlavaProcessor),
}

/// SmolVLM2's `video_sampling`: frames per second it assumes and at most how many it
/// takes, each frame's longest side.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VideoSampling {
    pub fps: f64,
    pub max_frames: usize,
    pub longest_edge: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub tower: TowerConfig,
    pub connector: Connector,
    pub processor: Processor,
    /// The placeholder token the features replace, and its text.
    pub image_token_id: u32,
    pub image_token: String,
    /// Features per image tile as the connector emits them (LLaVA-1.5 and Idefics3: the
    /// prompt's count per tile).
    pub tile_tokens: usize,
}

impl VisionConfig {
    /// The vision half of the model in `dir`, or None for a text-only model (no
    /// `vision_config` in its config.json).
    pub fn read(dir: &Path) -> Result<Option<Self>, LoadError> {
        let path = dir.join("config.json");
        let config = read_json(&path)?;
        let Some(vision) = config.get("vision_config") else { return Ok(None) };
        let model_type = str_of(&config, "model_type").unwrap_or_default();
        let bad = |key: &str, detail: String| LoadError::metadata(&path, key, detail);
        let (image_processor, processor_extra) = read_processor(dir)?;
        let pp = Fields { json: &image_processor, file: &path };
        let image_token_id = config
            .get("image_token_id")
            .or(config.get("image_token_index"))
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("image_token_id", "missing".into()))? as u32;
        match model_type.as_str() {
            "idefics3" | "smolvlm" => {
                let tower = tower(&path, vision, TowerKind::Siglip)?;
                let scale_factor = config.get("scale_factor").and_then(Value::as_u64).unwrap_or(2) as usize;
                if scale_factor == 0 || !tower.grid().is_multiple_of(scale_factor) {
                    return Err(bad(
                        "scale_factor",
                        format!("{scale_factor} does not divide {} patches", tower.grid()),
                    ));
                }
                let tile_tokens = tower.patches() / (scale_factor * scale_factor);
                let seq_len = processor_extra.get("image_seq_len").and_then(Value::as_u64).map(|v| v as usize);
                if seq_len.is_some_and(|n| n != tile_tokens) {
                    return Err(bad(
                        "image_seq_len",
                        format!("{seq_len:?} but the encoder makes {tile_tokens} a tile"),
                    ));
                }
                let tile = pp.edge("max_image_size", "longest_edge")?.unwrap_or(364);
                if tile as usize != tower.image_size {
                    return Err(bad(
                        "max_image_size",
                        format!("tiles of {tile} for an encoder of {}", tower.image_size),
                    ));
                }
                let geometry = Idefics3Geometry {
                    longest_edge: pp.edge("size", "longest_edge")?.unwrap_or(4 * 364),
                    tile,
                    image_seq_len: tile_tokens,
                };
                let processor = Idefics3Processor {
                    geometry,
                    resample: pp.resample(Filter::Lanczos)?,
                    values: pp.values([0.5; 3], [0.5; 3])?,
                };
                let video = image_processor.get("video_sampling").map(|v| VideoSampling {
                    fps: v.get("fps").and_then(Value::as_f64).unwrap_or(1.0),
                    max_frames: v.get("max_frames").and_then(Value::as_u64).unwrap_or(64) as usize,
                    longest_edge: v
                        .get("video_size")
                        .and_then(|s| s.get("longest_edge"))
                        .and_then(Value::as_u64)
                        .map_or(tile, |e| e as u32),
                });
                Ok(Some(Self {
                    tower,
                    connector: Connector::PixelShuffle { scale_factor },
                    processor: Processor::Idefics3 { processor, markers: Idefics3Markers::default(), video },
                    image_token_id,
                    image_token: Idefics3Markers::default().image,
                    tile_tokens,
                }))
            }
            "llava" | "llava_next" => {
                let kind = match str_of(vision, "model_type").as_deref() {
                    Some("clip_vision_model") | None => TowerKind::Clip,
                    Some("siglip_vision_model") => TowerKind::Siglip,
                    Some(other) => return Err(bad("vision_config.model_type", format!("{other:?} is not supported"))),
                };
                let tower = tower(&path, vision, kind)?;
                let layer = match config.get("vision_feature_layer") {
                    None => -2,
                    Some(v) => v.as_i64().ok_or_else(|| {
                        bad("vision_feature_layer", "only a single layer is supported, not a list".into())
                    })?,
                };
                // hidden_states[0] is the embeddings, [i] the output of layer i.
                let states = tower.num_layers as i64 + 1;
                let index = if layer < 0 { states + layer } else { layer };
                if !(0..states).contains(&index) {
                    return Err(bad("vision_feature_layer", format!("{layer} of {} layers", tower.num_layers)));
                }
                let strategy = str_of(&config, "vision_feature_select_strategy").unwrap_or_else(|| "default".into());
                let drop_first = match strategy.as_str() {
                    "default" => true,
                    "full" => false,
                    other => return Err(bad("vision_feature_select_strategy", format!("{other:?}"))),
                };
                let act = gelu(&path, &str_of(&config, "projector_hidden_act").unwrap_or_else(|| "gelu".into()))?;
                let next = model_type == "llava_next";
                let pinpoints = match config.get("image_grid_pinpoints") {
                    Some(v) if next => serde_json::from_value::<Vec<(u32, u32)>>(v.clone())
                        .map_err(|e| bad("image_grid_pinpoints", e.to_string()))?,
                    _ if next => return Err(bad("image_grid_pinpoints", "missing".into())),
                    _ => Vec::new(),
                };
                let crop = match image_processor.get("crop_size") {
                    Some(c) => c.get("height").or(c.get("shortest_edge")).and_then(Value::as_u64).map(|v| v as u32),
                    None => None,
                }
                .unwrap_or(tower.image_size as u32);
                if crop as usize != tower.image_size {
                    return Err(bad("crop_size", format!("crops of {crop} for an encoder of {}", tower.image_size)));
                }
                let processor = LlavaProcessor {
                    shortest_edge: pp.edge("size", "shortest_edge")?.unwrap_or(crop),
                    crop,
                    resample: pp.resample(Filter::Bicubic)?,
                    values: pp.values(CLIP_MEAN, CLIP_STD)?,
                    pinpoints,
                };
                let tile_tokens = tower.seq_len() - usize::from(drop_first);
                if next && tile_tokens != tower.patches() {
                    return Err(bad(
                        "vision_feature_select_strategy",
                        format!(
                            "{strategy:?} leaves {tile_tokens} rows a tile, not the {} patches NeXT's grid needs",
                            tower.patches()
                        ),
                    ));
                }
                Ok(Some(Self {
                    tower,
                    connector: Connector::Mlp { layers: index as usize, drop_first, act, next },
                    processor: Processor::Llava(processor),
                    image_token_id,
                    image_token: str_of(&processor_extra, "image_token").unwrap_or_else(|| "<image>".into()),
                    tile_tokens,
                }))
            }
            other => Err(bad(
                "model_type",
                format!("vision models of type {other:?} are not supported (idefics3, smolvlm, llava, llava_next are)"),
            )),
        }
    }
}

impl VisionConfig {
    /// What the control plane needs to render and count an image's placeholder.
    pub fn card(&self) -> pb::VisionCard {
        use pb::vision_card::Family;
        let family = match &self.processor {
            Processor::Idefics3 { processor, markers, video } => Family::Idefics3(pb::Idefics3Vision {
                longest_edge: processor.geometry.longest_edge,
                tile: processor.geometry.tile,
                image_seq_len: processor.geometry.image_seq_len as u32,
                fake_image_token: markers.around.clone(),
                global_image_token: markers.global.clone(),
                video_max_frames: video.map_or(0, |v| v.max_frames as u32),
                video_fps: video.map_or(0.0, |v| v.fps),
            }),
            Processor::Llava(p) => Family::Llava(pb::LlavaVision {
                tile_tokens: self.tile_tokens as u32,
                tile: p.crop,
                grid: self.tower.grid() as u32,
                pinpoints: p.pinpoints.iter().flat_map(|&(h, w)| [h, w]).collect(),
            }),
        };
        pb::VisionCard {
            image_token: self.image_token.clone(),
            image_token_id: self.image_token_id,
            family: Some(family),
        }
    }
}

/// OpenAI's CLIP normalisation, the LLaVA processors' default.
const CLIP_MEAN: [f32; 3] = [0.481_454_67, 0.457_827_5, 0.408_210_72];
const CLIP_STD: [f32; 3] = [0.268_629_55, 0.261_302_6, 0.275_777_1];

fn read_json(path: &Path) -> Result<Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| LoadError::format(path, e.to_string()))
}

fn str_of(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_string)
}

/// The image processor's fields, and the processor's own (`image_seq_len`, ...).
fn read_processor(dir: &Path) -> Result<(Value, Value), LoadError> {
    let processor_path = dir.join("processor_config.json");
    let processor = if processor_path.exists() { read_json(&processor_path)? } else { Value::Null };
    let pre = dir.join("preprocessor_config.json");
    let image = if pre.exists() {
        read_json(&pre)?
    } else if let Some(nested) = processor.get("image_processor") {
        nested.clone()
    } else {
        return Err(LoadError::format(
            dir,
            "no preprocessor_config.json, nor an image_processor in processor_config.json",
        ));
    };
    Ok((image, processor))
}

fn gelu(file: &Path, name: &str) -> Result<Gelu, LoadError> {
    match name {
        "gelu" => Ok(Gelu::Erf),
        "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Ok(Gelu::Tanh),
        "quick_gelu" => Ok(Gelu::Quick),
        other => Err(LoadError::metadata(file, "hidden_act", format!("{other:?} is not supported"))),
    }
}

/// The tower's sizes, with its configuration class's defaults.
fn tower(file: &Path, v: &Value, kind: TowerKind) -> Result<TowerConfig, LoadError> {
    // CLIPVisionConfig, SiglipVisionConfig and Idefics3VisionConfig defaults.
    let idefics = matches!(str_of(v, "model_type").as_deref(), Some("idefics3_vision" | "smolvlm_vision"));
    let (hidden, inter, layers, heads, image, patch, act, eps) = match kind {
        TowerKind::Clip => (768, 3072, 12, 12, 224, 32, "quick_gelu", 1e-5),
        TowerKind::Siglip if idefics => (1152, 3072, 12, 16, 224, 32, "gelu_pytorch_tanh", 1e-6),
        TowerKind::Siglip => (768, 3072, 12, 12, 224, 16, "gelu_pytorch_tanh", 1e-6),
    };
    let n = |key: &str, default: usize| v.get(key).and_then(Value::as_u64).map_or(default, |x| x as usize);
    let t = TowerConfig {
        kind,
        hidden_size: n("hidden_size", hidden),
        intermediate_size: n("intermediate_size", inter),
        num_layers: n("num_hidden_layers", layers),
        num_heads: n("num_attention_heads", heads),
        image_size: n("image_size", image),
        patch_size: n("patch_size", patch),
        act: gelu(file, &str_of(v, "hidden_act").unwrap_or_else(|| act.into()))?,
        layer_norm_eps: v.get("layer_norm_eps").and_then(Value::as_f64).unwrap_or(eps) as f32,
    };
    let bad = |detail: String| Err(LoadError::metadata(file, "vision_config", detail));
    if n("num_channels", 3) != 3 {
        return bad("only 3-channel encoders are supported".into());
    }
    if t.patch_size == 0 || !t.image_size.is_multiple_of(t.patch_size) || t.image_size == 0 {
        return bad(format!("images of {} in patches of {}", t.image_size, t.patch_size));
    }
    if t.num_heads == 0 || !t.hidden_size.is_multiple_of(t.num_heads) {
        return bad(format!("{} wide in {} heads", t.hidden_size, t.num_heads));
    }
    Ok(t)
}

/// Reading the image processor's fields with the file named in errors.
struct Fields<'a> {
    json: &'a Value,
    file: &'a Path,
}

impl Fields<'_> {
    /// `size.longest_edge` and the like; None when absent.
    fn edge(&self, key: &str, edge: &str) -> Result<Option<u32>, LoadError> {
        match self.json.get(key) {
            None => Ok(None),
            Some(v) => match v.get(edge).and_then(Value::as_u64) {
                Some(e) if e > 0 && e <= 1 << 16 => Ok(Some(e as u32)),
                _ => Err(LoadError::metadata(self.file, key, format!("no usable {edge} in {v}"))),
            },
        }
    }

    fn resample(&self, default: Filter) -> Result<Filter, LoadError> {
        match self.json.get("resample").and_then(Value::as_u64) {
            None => Ok(default),
            Some(v) => Filter::from_pil(v as u8)
                .ok_or_else(|| LoadError::metadata(self.file, "resample", format!("filter {v} is not supported"))),
        }
    }

    fn values(&self, mean: [f32; 3], std: [f32; 3]) -> Result<Values, LoadError> {
        let triple = |key: &str, default: [f32; 3]| -> Result<[f32; 3], LoadError> {
            match self.json.get(key) {
                None => Ok(default),
                Some(v) => serde_json::from_value::<[f32; 3]>(v.clone())
                    .map_err(|e| LoadError::metadata(self.file, key, e.to_string())),
            }
        };
        let on = |key: &str| self.json.get(key).and_then(Value::as_bool).unwrap_or(true);
        // A processor that skips normalising or rescaling is one no family here ships.
        if !on("do_rescale") || !on("do_normalize") {
            return Err(LoadError::metadata(
                self.file,
                "do_normalize",
                "processors that skip rescaling or normalising are not supported",
            ));
        }
        Ok(Values {
            rescale_factor: self.json.get("rescale_factor").and_then(Value::as_f64).unwrap_or(1.0 / 255.0),
            mean: triple("image_mean", mean)?,
            std: triple("image_std", std)?,
        })
    }
}
