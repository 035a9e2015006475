//! `tessera-worker serve`: load a model, start the engine thread, serve gRPC.

use crate::device;
use crate::engine::core::{
    CPU_CONTENDED_BATCH, DECODE_PROMPT_STEP_PERCENT, DEFAULT_GRAPH_BATCH_SIZES, DEFAULT_PROMPT_STEP_PERCENT,
    EngineConfig, EngineCore,
};
use crate::engine::kv_tier::TierConfig;
use crate::engine::runner::EngineHandle;
use crate::engine::speculate::{DEFAULT_SPEC_TOKENS, MAX_SPEC_TOKENS, SpecConfig, SpecMethod};
use crate::grpc::{WorkerServer, WorkerService};
use crate::load;
use crate::loader::TensorSource;
use crate::model::Model;
use crate::model::ModelConfig;
use crate::model::kv_block_bytes;
use crate::model_cache;
use crate::vision::service::{ImageEncoder, PlaceImages};
use anyhow::Context;
use std::future::Future;
use std::sync::Arc;
use tessera_kernels::Backend;
use tessera_kernels::collective::ThreadGroup;
use tessera_kernels::cpu::CpuBackend;
use tessera_proto::block_hash::BLOCK_TOKENS;
use tessera_proto::cluster::Role;
use tessera_proto::worker as pb;
use tokio::net::TcpListener;

/// Everything `serve` needs, from the command line or a test.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeConfig {
    /// A GGUF file, a Hugging Face model directory, or a known model name.
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: String,
    #[arg(long, env = "TESSERA_WORKER_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// KV-cache size in bytes; default: on the CPU `--kv-cache-fraction` of available
    /// memory, on a GPU what `--gpu-memory-fraction` leaves after the weights.
    #[arg(long)]
    pub kv_cache_bytes: Option<u64>,
    #[arg(long, default_value_t = 0.2)]
    pub kv_cache_fraction: f64,
    /// cpu, cuda, or auto: the GPU when one can be opened.
    #[arg(long, value_enum, default_value_t = device::Device::Auto)]
    pub device: device::Device,
    /// The GPUs to run on, one per rank (CUDA ordinals); default: 0, 1, … up to the
    /// tensor-parallel size.
    #[arg(long, value_delimiter = ',')]
    pub cuda_devices: Vec<usize>,
    /// Ranks the model is split over (Megatron-style): attention heads and MLP columns
    /// divided, one thread per rank; on CUDA one GPU per rank, summing through NCCL.
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub tensor_parallel_size: usize,
    /// Share of the GPU's memory the worker may fill (weights, activations, KV cache).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_fraction: f64,
    /// Decode batch sizes captured as CUDA graphs at start-up.
    #[arg(long, value_delimiter = ',', default_values_t = DEFAULT_GRAPH_BATCH_SIZES)]
    pub cuda_graph_sizes: Vec<usize>,
    /// Run every step op by op: no CUDA graphs (as vLLM's flag of the same name).
    #[arg(long)]
    pub enforce_eager: bool,
    /// This replica's name in its metrics' `replica` label.
    #[arg(long, default_value = "worker")]
    pub replica_id: String,
    /// Record no metrics (GET /metrics serves nothing).
    #[arg(long)]
    pub no_metrics: bool,
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// While others decode, a step with prompt chunks takes at most this percentage of
    /// a decode step's time, measured as the engine runs; 0: only
    /// --max-num-batched-tokens bounds it. Default 250, and 100 on a decode replica
    /// (disaggregated serving: the prompts it computes itself are short, and its
    /// streams' gaps are what it is for).
    #[arg(long)]
    pub prompt_step_percent: Option<u32>,
    /// While more than one organization has work here, a step runs at most this many
    /// rows, shared by their weights (fair sharing); default 8 on a CPU, --max-num-seqs
    /// on a GPU.
    #[arg(long)]
    pub contended_batch: Option<usize>,
    #[command(flatten)]
    pub kv_tier: KvTierArgs,
    /// Disaggregated serving: `prefill` computes prompts and hands each request, with
    /// its KV blocks, to a decode replica; `decode` takes them (and whole requests when
    /// no prefill replica can); `none` does both, as a replica does by default.
    #[arg(long, default_value = "none")]
    pub disaggregation_mode: Role,
    /// Memory for image features kept after encoding, so that a repeated image (and
    /// requests in flight with the same one) is encoded once; a vision model's only.
    #[arg(long, default_value_t = 256)]
    pub encoder_cache_mb: usize,
    /// Speculative decoding, where proposed tokens come from (`ngram`: the sequence's
    /// own prompt and output; `suffix`: those and the tenant's recent requests; `draft`:
    /// `--speculative-draft`'s model); off when not given. Verified by the model, so
    /// outputs are the same either way; only speed changes.
    #[arg(long, value_parser = |s: &str| s.parse::<SpecMethod>())]
    pub speculative: Option<SpecMethod>,
    /// Most tokens proposed for a sequence in one step (the engine verifies fewer when
    /// its measured costs say more would not pay).
    #[arg(long, default_value_t = DEFAULT_SPEC_TOKENS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=MAX_SPEC_TOKENS as u64))]
    pub speculative_tokens: usize,
    /// The draft model of `--speculative draft` (a GGUF file, a Hugging Face model
    /// directory, or a known model name), with the model's tokenizer.
    #[arg(long)]
    pub speculative_draft: Option<String>,
}

/// The second KV tier (`engine::kv_tier`), as the worker's flags give it (the agent's
/// too, where the folder holds one per replica).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct KvTierArgs {
    /// Host memory for KV blocks the cache evicts (the second tier): a prompt whose
    /// prefix was evicted copies it back instead of computing it again; 0: none.
    #[arg(long, default_value_t = 0)]
    pub kv_offload_bytes: u64,
    /// A folder for KV blocks evicted from the cache and from host memory, kept across
    /// restarts of a worker serving the same weights (a warm restart).
    #[arg(long)]
    pub kv_disk_path: Option<std::path::PathBuf>,
    /// Bytes `--kv-disk-path` may hold.
    #[arg(long, default_value_t = 8 << 30)]
    pub kv_disk_bytes: u64,
}

impl KvTierArgs {
    /// The tier's configuration for blocks of `identity`.
    pub fn config(&self, identity: String) -> TierConfig {
        TierConfig {
            host_bytes: self.kv_offload_bytes,
            disk: self.kv_disk_path.clone().map(|p| (p, self.kv_disk_bytes)),
            identity,
        }
    }
}

impl ServeConfig {
    /// Speculative decoding as configured, if on.
    pub fn spec_config(&self) -> Option<SpecConfig> {
        self.speculative.map(|method| SpecConfig {
            method,
            max_tokens: self.speculative_tokens,
            draft: self.speculative_draft.clone(),
        })
    }
}

/// Loads the model on the chosen device and starts the engine; returns the service
/// ready to serve.
pub fn build_service(config: &ServeConfig) -> anyhow::Result<WorkerService> {
    let path = model_cache::resolve(&config.model)?;
    let tp = config.tensor_parallel_size;
    let gpus: Vec<usize> = match config.cuda_devices.as_slice() {
        [] => (0..tp).collect(),
        named => named.to_vec(),
    };
    anyhow::ensure!(gpus.len() == tp, "--cuda-devices names {} GPUs for {tp} tensor-parallel ranks", gpus.len());
    let distinct: std::collections::BTreeSet<_> = gpus.iter().collect();
    anyhow::ensure!(distinct.len() == gpus.len(), "--cuda-devices names a GPU twice: {gpus:?}");
    let opened = device::open(config.device, gpus[0])?;
    tracing::info!("device: {}, tensor parallel size {tp}", opened.describe());
    match opened {
        device::Opened::Cpu(b) => build(
            &path,
            config,
            |model_config, source| {
                if tp == 1 {
                    return Ok(vec![Model::load(b, model_config.clone(), source)?]);
                }
                // One thread per rank, summing through the in-process all-reduce.
                ThreadGroup::ranks(tp)
                    .into_iter()
                    .map(|rank| {
                        Ok(Model::load_shard(CpuBackend::default(), model_config.clone(), source, Arc::new(rank))?)
                    })
                    .collect()
            },
            |model_config, source| Ok(Model::load(CpuBackend::default(), model_config.clone(), source)?),
            |hidden| encoder(CpuBackend::default(), &path, hidden, config),
            |_| {
                // The ranks share the machine's memory.
                let budget = config.kv_cache_bytes.unwrap_or_else(|| {
                    (available_memory().unwrap_or(4 << 30) as f64 * config.kv_cache_fraction) as u64
                });
                budget / tp as u64
            },
        ),
        #[cfg(feature = "cuda")]
        device::Opened::Cuda(b) => build(
            &path,
            config,
            |model_config, source| {
                if tp == 1 {
                    return Ok(vec![Model::load(*b, model_config.clone(), source)?]);
                }
                // One GPU per rank, summing through NCCL.
                let mut backends = vec![*b];
                for (rank, &gpu) in gpus.iter().enumerate().skip(1) {
                    let backend = tessera_kernels::cuda::CudaBackend::new(gpu);
                    backends.push(backend.with_context(|| format!("rank {rank} on GPU {gpu}"))?);
                }
                let comms = tessera_kernels::cuda::NcclRank::group(&backends.iter().collect::<Vec<_>>())?;
                backends
                    .into_iter()
                    .zip(comms)
                    .map(|(backend, comm)| {
                        Ok(Model::load_shard(backend, model_config.clone(), source, Arc::new(comm))?)
                    })
                    .collect()
            },
            // The draft's and the encoder's own handles on the first GPU: their own
            // streams and cuBLAS.
            |model_config, source| {
                Ok(Model::load(tessera_kernels::cuda::CudaBackend::new(gpus[0])?, model_config.clone(), source)?)
            },
            |hidden| encoder(tessera_kernels::cuda::CudaBackend::new(gpus[0])?, &path, hidden, config),
            |model| match config.kv_cache_bytes {
                Some(bytes) => bytes,
                None => gpu_kv_budget(model, config),
            },
        ),
    }
}

/// What is left for the KV cache on the GPU once the weights are loaded: the
/// `--gpu-memory-fraction` of the whole card, less what is in use, less room for one
/// step's activations at the token budget.
#[cfg(feature = "cuda")]
fn gpu_kv_budget(model: &Model<tessera_kernels::cuda::CudaBackend>, config: &ServeConfig) -> u64 {
    let Ok((free, total)) = model.backend().memory_info() else { return 0 };
    let c = &model.config;
    let per_token = c.q_width() + 2 * c.kv_width() + 4 * c.intermediate_size + 6 * c.hidden_size;
    let activations = config.max_num_batched_tokens * per_token * 2 * 2 + config.max_num_seqs * c.vocab_size * 8;
    let allowed = (total as f64 * config.gpu_memory_fraction) as i64 - (total - free) as i64;
    (allowed - activations as i64).max(0) as u64
}

/// What a KV block's contents depend on: the model and its weight files (as `file`
/// names each), the backend (a CPU stores f16, a GPU bf16: two bytes each), the cache's
/// element size and layout, and the tensor-parallel split.
fn block_identity<B: Backend>(
    path: &std::path::Path,
    model: &str,
    rank0: &Model<B>,
    ranks: usize,
    file: impl Fn(&std::path::Path) -> String,
) -> String {
    let mut files: Vec<String> = match std::fs::read_dir(path) {
        Ok(entries) => entries.filter_map(|e| e.ok()).map(|e| file(&e.path())).collect(),
        Err(_) => vec![file(path)],
    };
    files.sort();
    let c = &rank0.config;
    format!(
        "{model}|{}|{}|kv {} bytes|{} layers × {}|{BLOCK_TOKENS}-token blocks|{ranks} ranks",
        files.join(","),
        rank0.backend().name(),
        rank0.backend().kv_element_bytes(),
        c.num_layers,
        c.kv_width(),
    )
}

/// The disk tier's identity: files named with their sizes and modification times. A
/// disk tier serves blocks only to a worker with the same.
fn kv_identity<B: Backend>(path: &std::path::Path, model: &str, rank0: &Model<B>, ranks: usize) -> String {
    block_identity(path, model, rank0, ranks, file_identity)
}

/// The identity replicas exchanging blocks compare (`ModelCard::kv_identity`): without
/// the files' times, since another node's copy of the weights has the same bytes. Hex
/// SHA-256.
fn transfer_identity<B: Backend>(path: &std::path::Path, model: &str, rank0: &Model<B>, ranks: usize) -> String {
    use sha2::{Digest, Sha256};
    let sized = |p: &std::path::Path| {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        format!("{name}:{}", std::fs::metadata(p).map_or(0, |m| m.len()))
    };
    let text = block_identity(path, model, rank0, ranks, sized);
    Sha256::digest(text.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

fn file_identity(path: &std::path::Path) -> String {
    let meta = std::fs::metadata(path).ok();
    let modified =
        meta.as_ref().and_then(|m| m.modified().ok()).and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
    format!(
        "{}:{}:{}",
        path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default(),
        meta.map_or(0, |m| m.len()),
        modified.map_or(0, |d| d.as_nanos())
    )
}

/// Opens the model at `path`, loads its ranks with `load_ranks` (one model, or the
/// shards of a tensor-parallel group, rank 0 first) and a draft model with
/// `load_draft` if speculation drafts, sizes each rank's KV cache from `kv_budget`
/// (bytes per rank) and starts the engine.
fn build<B: Backend + 'static>(
    path: &std::path::Path,
    config: &ServeConfig,
    load_ranks: impl FnOnce(&ModelConfig, &dyn TensorSource) -> anyhow::Result<Vec<Model<B>>>,
    load_draft: impl FnOnce(&ModelConfig, &dyn TensorSource) -> anyhow::Result<Model<B>>,
    load_encoder: impl FnOnce(usize) -> anyhow::Result<Option<Arc<Encoder>>>,
    kv_budget: impl FnOnce(&Model<B>) -> u64,
) -> anyhow::Result<WorkerService> {
    let (model_config, tokenizer, source) = load::open(path).with_context(|| format!("opening {}", path.display()))?;
    let ranks = load_ranks(&model_config, &*source).with_context(|| format!("loading {}", path.display()))?;
    let draft = match config.spec_config() {
        Some(SpecConfig { method: SpecMethod::Draft, draft, .. }) => {
            anyhow::ensure!(ranks.len() == 1, "a draft model runs beside one rank: tensor parallelism has none");
            let name = draft.context("--speculative draft needs --speculative-draft <model>")?;
            Some(open_draft(&name, &tokenizer, load_draft)?)
        }
        _ => None,
    };
    let encoder = load_encoder(model_config.hidden_size)
        .with_context(|| format!("loading {}'s vision encoder", path.display()))?;
    anyhow::ensure!(
        encoder.is_none() || ranks.len() == 1,
        "vision models run on one rank: tensor parallelism splits only text models"
    );
    let rank0 = ranks.first().context("no ranks")?;
    let block_bytes = kv_block_bytes(
        rank0.backend().kv_element_bytes(),
        rank0.config.num_layers,
        rank0.config.kv_width(),
        BLOCK_TOKENS,
    ) as u64;
    // A draft keeps as many blocks as the model, in the same budget.
    let draft_block_bytes = draft.as_ref().map_or(0, |d| {
        kv_block_bytes(d.backend().kv_element_bytes(), d.config.num_layers, d.config.kv_width(), BLOCK_TOKENS) as u64
    });
    let budget = kv_budget(rank0);
    let num_blocks = (budget / (block_bytes + draft_block_bytes)) as usize;
    anyhow::ensure!(num_blocks > 0, "a KV cache of {budget} bytes holds no block of {block_bytes} bytes");
    let engine_config = EngineConfig {
        max_num_batched_tokens: config.max_num_batched_tokens,
        max_num_seqs: config.max_num_seqs,
        num_blocks,
        graph_batch_sizes: if config.enforce_eager { Vec::new() } else { config.cuda_graph_sizes.clone() },
        prompt_step_percent: config.prompt_step_percent.unwrap_or(match config.disaggregation_mode {
            Role::Decode => DECODE_PROMPT_STEP_PERCENT,
            _ => DEFAULT_PROMPT_STEP_PERCENT,
        }),
        speculative: config.spec_config(),
        contended_batch: config.contended_batch.unwrap_or(match rank0.backend().name() {
            "cpu" => CPU_CONTENDED_BATCH,
            _ => config.max_num_seqs,
        }),
        kv_tiers: TierConfig {
            // Blocks from prefill replicas arrive in the host tier: a decode replica has
            // one, by default as large as its device cache.
            host_bytes: match (config.disaggregation_mode, config.kv_tier.kv_offload_bytes) {
                (Role::Decode, 0) => num_blocks as u64 * block_bytes,
                (_, bytes) => bytes,
            },
            ..config.kv_tier.config(kv_identity(path, &config.model, rank0, ranks.len()))
        },
    };
    let kv_identity = transfer_identity(path, &config.model, rank0, ranks.len());
    let ranks_count = ranks.len() as u64;
    let core = if ranks.len() == 1 {
        let model = ranks.into_iter().next().context("no ranks")?;
        match draft {
            Some(draft) => EngineCore::with_draft(model, draft, tokenizer, engine_config, &config.model)?,
            None => EngineCore::new(model, tokenizer, engine_config, &config.model)?,
        }
    } else {
        EngineCore::tensor_parallel(ranks, tokenizer, engine_config, &config.model)?
    };
    let context_length = core.max_model_len();
    if context_length < model_config.context_length {
        tracing::warn!(
            "the KV cache holds {context_length} tokens, less than the model's context of {}: \
             requests may use {context_length} (a larger --kv-cache-bytes or --gpu-memory-fraction gives more)",
            model_config.context_length
        );
    }
    let c = &model_config;
    let tok = core.tokenizer();
    let card = pb::ModelCard {
        model: config.model.clone(),
        tokenizer_json: tok.json.clone(),
        chat_template: tok.chat_template.clone().unwrap_or_default(),
        bos_token_id: tok.bos.as_ref().map(|t| t.id),
        bos_token: tok.bos.as_ref().map(|t| t.text.clone()).unwrap_or_default(),
        eos_token_ids: tok.eos.iter().map(|t| t.id).collect(),
        eos_token: tok.eos.first().map(|t| t.text.clone()).unwrap_or_default(),
        context_length: context_length as u32,
        kv_block_size: BLOCK_TOKENS as u32,
        vocab_size: c.vocab_size as u32,
        vision: encoder.as_ref().map(|e| e.card.clone()),
        role: config.disaggregation_mode.proto() as i32,
        kv_identity,
    };
    let recorder = match config.no_metrics {
        true => None,
        false => Some(crate::metrics::registry(&config.model, &config.replica_id)),
    };
    let (engine, metrics) = match recorder {
        None => (EngineHandle::spawn(core), None),
        Some((recorder, metrics)) => (EngineHandle::spawn_recording(core, Some(recorder)), Some(metrics)),
    };
    // A saved block holds every rank's share.
    let mut service = WorkerService::new(engine, card).with_kv_block_bytes(block_bytes * ranks_count);
    if let Some(metrics) = metrics {
        service = service.with_metrics(metrics);
    }
    if let Some(e) = encoder {
        service = service.with_images(e.place.clone());
    }
    Ok(service)
}

/// The draft model `name` (a path or a known model's name), loaded with `load` once its
/// tokenizer is found to be the model's (`tokenizer`): the same vocabulary and end
/// tokens, and the same tokens for a probe text.
fn open_draft<B: Backend>(
    name: &str,
    tokenizer: &crate::tokenizer::ModelTokenizer,
    load: impl FnOnce(&ModelConfig, &dyn TensorSource) -> anyhow::Result<Model<B>>,
) -> anyhow::Result<Model<B>> {
    let path = model_cache::resolve(name).with_context(|| format!("the draft model {name}"))?;
    let (draft_config, draft_tokenizer, source) =
        load::open(&path).with_context(|| format!("opening the draft model {}", path.display()))?;
    let probe = "def mean(xs):\n    return sum(xs) / len(xs)  # ünïcode, 数字 42";
    let same = draft_tokenizer.vocab_size() == tokenizer.vocab_size()
        && draft_tokenizer.eos.iter().map(|t| t.id).eq(tokenizer.eos.iter().map(|t| t.id))
        && draft_tokenizer.encode(probe).ok() == tokenizer.encode(probe).ok();
    anyhow::ensure!(same, "the draft model {name} has another tokenizer than the model: a draft needs the model's");
    let draft = load(&draft_config, &*source).with_context(|| format!("loading the draft model {}", path.display()))?;
    tracing::info!("drafting with {name} ({} layers)", draft.config.num_layers);
    Ok(draft)
}

/// A vision model's encoder, as the service uses it and the card describes it.
struct Encoder {
    place: Arc<dyn PlaceImages>,
    card: pb::VisionCard,
}

/// The encoder of the model at `path` on `backend`, None for a text-only model.
fn encoder<B: Backend + 'static>(
    backend: B,
    path: &std::path::Path,
    hidden: usize,
    config: &ServeConfig,
) -> anyhow::Result<Option<Arc<Encoder>>> {
    let Some(model) = load::open_vision(&backend, path, hidden)? else { return Ok(None) };
    let card = model.config.card();
    let place = Arc::new(ImageEncoder::new(backend, model, config.encoder_cache_mb << 20));
    Ok(Some(Arc::new(Encoder { place, card })))
}

/// Serves on `listener` until `shutdown` resolves.
pub async fn serve(
    service: WorkerService,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    // At shutdown, load streams end with it: the graceful shutdown waits only for the
    // generations running.
    let (closing, closed) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        shutdown.await;
        let _ = closing.send(true);
    };
    // gRPC, and beside it (over HTTP/1.1) GET /metrics for Prometheus.
    let metrics = service.metrics.clone();
    let engine = service.engine();
    // A request carries its images' bytes: up to the control plane's per-request cap,
    // far over tonic's 4 MiB default.
    let server =
        WorkerServer::new(service.closing_on(closed)).max_decoding_message_size(tessera_proto::MAX_MESSAGE_BYTES);
    let routes = tonic::service::Routes::new(server)
        .into_axum_router()
        .route("/metrics", axum::routing::get(move || render(metrics.clone())));
    tonic::transport::Server::builder()
        .accept_http1(true)
        .add_routes(routes.into())
        .serve_with_incoming_shutdown(incoming(listener), shutdown)
        .await?;
    // Drained: what the KV cache holds goes to the disk tier, for the next start.
    match engine.stop().await {
        Ok(0) => {}
        Ok(n) => tracing::info!("kept {n} KV blocks on disk for the next start"),
        Err(e) => tracing::warn!("stopping the engine: {e}"),
    }
    Ok(())
}

/// Connections accepted with TCP_NODELAY. Tokens go out one small frame at a time: with
/// Nagle's algorithm a frame waits for the ACK of the one before, which the peer's delayed
/// ACK holds up to 40 ms (measured: inter-token p99 44-47 ms, 32-35 ms without it).
fn incoming(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Prometheus's text format: the replica's registry (empty without one).
async fn render(metrics: Option<metrics_exporter_prometheus::PrometheusHandle>) -> impl axum::response::IntoResponse {
    let text = metrics.map_or_else(String::new, |h| {
        h.run_upkeep();
        h.render()
    });
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

/// MemAvailable from /proc/meminfo, in bytes.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = info.lines().find(|l| l.starts_with("MemAvailable:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn accepted_connections_send_small_frames_without_delay() {
        let listener = super::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = super::incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap());
    }
}
