//! The worker's command line: serve a model over gRPC, run as a cluster node, generate
//! text once, or fetch a model. `tessera-worker` is this; `tessera worker` (hidden) is
//! the same, built into the control plane's binary for `tessera serve`.

use crate::device::{self, Device, Opened};
use crate::telemetry::{self, TraceConfig};
use crate::{generate, load, model_cache};
use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use tessera_kernels::Backend;
use tessera_proto::chat_template::{ChatTemplate, Message};

#[derive(Parser)]
#[command(name = "tessera-worker", version, about = "Tessera worker")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub traces: TraceConfig,
}

#[derive(Subcommand)]
pub enum Command {
    /// Greedy completion of one prompt.
    Generate(GenerateArgs),
    /// Serve the model over gRPC (worker.proto) with the batching engine.
    Serve(crate::serve::ServeConfig),
    /// Run this machine as a node of a cluster: register in etcd, serve the replicas
    /// placed on it, drain on SIGTERM.
    Agent(crate::agent::AgentConfig),
    /// Fetch a known model into the cache and print its path.
    Fetch {
        #[arg(default_value = model_cache::SMOLLM2_135M_INSTRUCT.name)]
        name: String,
    },
}

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// A GGUF file, a Hugging Face model directory, or a known model name.
    #[arg(long, env = "TESSERA_MODEL")]
    model: String,
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Print one JSON object: prompt_token_ids, output_token_ids, text.
    #[arg(long)]
    json: bool,
    /// cpu, cuda, or auto: the GPU when one can be opened.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
}

/// Runs one command to its end (each starts the async runtime it needs, so this is
/// called outside any), logging and tracing as `traces` and TESSERA_LOG_FORMAT say.
pub fn run(command: Command, traces: &TraceConfig) -> Result<()> {
    let runtime = tokio::runtime::Runtime::new()?;
    // The trace exporter's channel runs on this runtime, which serves the requests too.
    let _telemetry = {
        let _inside = runtime.enter();
        telemetry::init(telemetry::json_from_env(), "warn,tessera_worker=info", traces, "tessera-worker")?
    };
    match command {
        Command::Generate(args) => run_generate(args),
        Command::Serve(config) => run_serve(&runtime, config),
        Command::Agent(config) => runtime.block_on(crate::agent::run(config)),
        Command::Fetch { name } => {
            println!("{}", model_cache::resolve(&name)?.display());
            Ok(())
        }
    }
}

fn run_serve(runtime: &tokio::runtime::Runtime, config: crate::serve::ServeConfig) -> Result<()> {
    let service = crate::serve::build_service(&config)?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        // Not a log line: `tessera serve` reads the address from this one, whatever the
        // log format.
        eprintln!("tessera-worker serving {} on {}", config.model, listener.local_addr()?);
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        crate::serve::serve(service, listener, shutdown).await
    })
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    match device::open(args.device, 0)? {
        Opened::Cpu(b) => generate_on(b, args),
        #[cfg(feature = "cuda")]
        Opened::Cuda(b) => generate_on(*b, args),
    }
}

fn generate_on<B: Backend>(backend: B, args: GenerateArgs) -> Result<()> {
    let path = model_cache::resolve(&args.model)?;
    let loaded = load::load_model(backend, &path).with_context(|| format!("loading {}", path.display()))?;
    let tok = &loaded.tokenizer;
    let prompt = if args.chat {
        let source = tok.chat_template.as_deref().context("the model has no chat template")?;
        let text = |t: &Option<crate::tokenizer::TokenInfo>| t.as_ref().map(|t| t.text.clone()).unwrap_or_default();
        let template = ChatTemplate::new(source, &text(&tok.bos), &text(&tok.eos.first().cloned()))?;
        template.render(&[Message::new("user", &args.prompt)], true)?
    } else {
        args.prompt.clone()
    };
    let prompt_ids = tok.encode(&prompt).map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
    anyhow::ensure!(!prompt_ids.is_empty(), "the prompt is empty");
    let stop: Vec<u32> = tok.eos.iter().map(|t| t.id).collect();
    let run = generate::greedy(&loaded.model, &prompt_ids, args.max_tokens, &stop)?;
    let text = tok.decode(&run.output).map_err(|e| anyhow::anyhow!("decoding: {e}"))?;
    if args.json {
        let out = serde_json::json!({"prompt_token_ids": prompt_ids, "output_token_ids": run.output, "text": text});
        println!("{out}");
    } else {
        println!("{text}");
    }
    Ok(())
}
