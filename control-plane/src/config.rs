//! The command line: one typed struct per command.

use crate::accounts::BillingMode;
use crate::billing::plans::Plan;
use crate::router::choice::Routing;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use tessera_proto::speculative::{DEFAULT_SPEC_TOKENS, SpecConfig, SpecMethod};

#[derive(Parser)]
#[command(name = "tessera", version, about = "Tessera: an OpenAI-compatible LLM serving cluster")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Log lines as text, or as JSON objects (one per line, with the request's id in
    /// every line of a request). The level is RUST_LOG's (default: warnings, and each
    /// API request answered, and where console e-mail went).
    #[arg(long, global = true, value_enum, env = "TESSERA_LOG_FORMAT", default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Traces over OTLP: this process's, and its local workers'.
    #[command(flatten)]
    pub traces: tessera_worker::telemetry::TraceConfig,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
pub enum Command {
    /// Runs the API on one machine, with local workers and a SQLite database.
    Serve(ServeConfig),
    /// The worker built into this binary (`tessera-worker`'s commands): what `tessera
    /// serve` starts when no `tessera-worker` lies beside it.
    #[command(subcommand, hide = true)]
    Worker(tessera_worker::cli::Command),
    /// Runs a control plane of a cluster: placement through etcd (one leader among the
    /// control planes), the API over the replicas the nodes serve, a shared database.
    ControlPlane(ClusterConfig),
    /// Operator commands for organizations.
    #[command(subcommand)]
    Orgs(OrgsCommand),
    /// Operator commands for API keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Operator commands for prepaid credit.
    #[command(subcommand)]
    Credits(CreditsCommand),
    /// What requests used and cost.
    #[command(subcommand)]
    Usage(UsageCommand),
    /// Operator commands for personal accounts.
    #[command(subcommand)]
    Users(UsersCommand),
    /// Requests for dedicated GPU capacity sent from the console.
    #[command(subcommand)]
    Capacity(CapacityCommand),
    /// Operator commands for personal subscription plans.
    #[command(subcommand)]
    Plans(PlansCommand),
    /// Each model's supply state (the subscription discount) and its history.
    #[command(subcommand)]
    Supply(SupplyCommand),
    /// The cluster's nodes (etcd).
    #[command(subcommand)]
    Nodes(NodesCommand),
    /// Desired replicas per model (etcd).
    #[command(subcommand)]
    Deployments(DeploymentsCommand),
    /// The replicas running in the cluster (etcd).
    #[command(subcommand)]
    Replicas(ReplicasCommand),
}

/// Where the cluster's state is: etcd.
#[derive(Args, Clone, Debug)]
pub struct EtcdArgs {
    /// etcd endpoints, comma-separated.
    #[arg(long, env = "TESSERA_ETCD", value_delimiter = ',', required = true)]
    pub etcd: Vec<String>,
}

/// Where accounts are stored; shared by `serve` and the operator commands.
#[derive(Args, Clone, Debug)]
pub struct StoreArgs {
    /// Folder for the SQLite database and the bootstrap key.
    #[arg(long, env = "TESSERA_DATA_DIR", default_value_os_t = default_data_dir())]
    pub data_dir: PathBuf,
    /// Database URL (sqlite://PATH or postgres://…); default: SQLite in the data folder.
    #[arg(long, env = "TESSERA_DATABASE_URL")]
    pub database: Option<String>,
}

impl StoreArgs {
    pub fn database_url(&self) -> String {
        self.database.clone().unwrap_or_else(|| format!("sqlite://{}", self.data_dir.join("tessera.db").display()))
    }
}

fn default_data_dir() -> PathBuf {
    match std::env::var_os("HOME") {
        Some(home) => PathBuf::from(home).join(".local/share/tessera"),
        None => PathBuf::from("tessera-data"),
    }
}

#[derive(Args, Clone, Debug)]
pub struct ServeConfig {
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub api: ApiArgs,
    /// The `tessera-worker` binary; default: the one beside this binary, else the worker
    /// built into this one.
    #[arg(long, env = "TESSERA_WORKER_BIN")]
    pub worker_bin: Option<PathBuf>,
    /// KV cache size of each worker, in bytes (default: the worker's).
    #[arg(long)]
    pub kv_cache_bytes: Option<u64>,
    /// Host memory of each worker for KV blocks its cache evicts (the second tier): a
    /// prompt whose prefix was evicted copies it back instead of computing it again.
    #[arg(long)]
    pub kv_offload_bytes: Option<u64>,
    /// Disk for each worker's evicted KV blocks, under `<data-dir>/kv-cache/<replica>`,
    /// kept across restarts (a warm restart); off when not given.
    #[arg(long)]
    pub kv_disk_bytes: Option<u64>,
    /// Each worker's fair sharing: while organizations contend, a step runs at most this
    /// many rows, split by their weights (default: 8 on a CPU, the batch limit on a GPU).
    #[arg(long)]
    pub contended_batch: Option<usize>,
    /// Local workers (data-parallel replicas) for each model's weights, routed by
    /// `--routing`; default 1, or 0 beside prefill and decode workers.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub replicas: Option<u32>,
    /// Disaggregated serving: local workers for each model's weights that only compute
    /// prompts, handing each request with its KV blocks to a decode worker.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub prefill_replicas: u32,
    /// Local workers that decode what prefill workers hand over (and whole requests
    /// when none can).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=64))]
    pub decode_replicas: u32,
    /// Credit granted to the bootstrap organization on first start, in US dollars.
    #[arg(long, env = "TESSERA_DEV_CREDIT_USD", default_value_t = 100.0)]
    pub dev_credit_usd: f64,
    /// Speculative decoding: `catalog` (each model as its catalog entry says), `off`
    /// for every model, or a method (`ngram`, `suffix`) for every model; `draft` names
    /// its draft model per model, so only the catalog sets it. Outputs are the same
    /// either way; only speed changes.
    #[arg(long, default_value = "catalog", value_parser = Speculative::parse)]
    pub speculative: Speculative,
}

/// `tessera serve --speculative`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speculative {
    Catalog,
    Off,
    Every(SpecMethod),
}

impl Speculative {
    fn parse(s: &str) -> anyhow::Result<Self> {
        match s {
            "catalog" => Ok(Speculative::Catalog),
            "off" => Ok(Speculative::Off),
            "draft" => anyhow::bail!(
                "draft speculation names a draft model per model: set `speculative = {{ method = \"draft\", \
                 draft = \"<model>\" }}` in the catalog and use --speculative catalog"
            ),
            method => method.parse().map(Speculative::Every).map_err(|e| anyhow::anyhow!("{e}; or catalog, or off")),
        }
    }

    /// The settings a worker runs with, given its catalog entry's.
    pub fn apply(self, catalog: Option<SpecConfig>) -> Option<SpecConfig> {
        match self {
            Speculative::Catalog => catalog,
            Speculative::Off => None,
            Speculative::Every(method) => Some(SpecConfig {
                method,
                max_tokens: catalog.map_or(DEFAULT_SPEC_TOKENS, |c| c.max_tokens),
                draft: None,
            }),
        }
    }
}

/// `tessera control-plane`: several may run against one etcd and one database.
#[derive(Args, Clone, Debug)]
pub struct ClusterConfig {
    /// etcd endpoint, e.g. http://127.0.0.1:2379.
    #[arg(long, env = "TESSERA_ETCD")]
    pub etcd: String,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub api: ApiArgs,
    /// Seconds a leader's election lease lasts: a standby takes over within it.
    #[arg(long, default_value_t = 5)]
    pub lease_ttl_secs: i64,
    /// Seconds a vanished node's replicas wait for it to come back before moving.
    #[arg(long, default_value_t = 10)]
    pub node_grace_secs: u64,
}

/// The HTTP API's settings and the models it offers, the same in both modes.
#[derive(Args, Clone, Debug)]
pub struct ApiArgs {
    /// Model catalog (TOML); default: the built-in deploy/catalog.toml.
    #[arg(long, env = "TESSERA_CATALOG")]
    pub catalog: Option<PathBuf>,
    /// Address of the HTTP API.
    #[arg(long, env = "TESSERA_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Seconds in-flight requests get to finish after SIGINT or SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// Requests per minute per organization, unless the organization has its own limit.
    #[arg(long, env = "TESSERA_RATE_LIMIT_RPM", default_value_t = 200)]
    pub rate_limit_rpm: u32,
    /// Requests an organization may send at once after a quiet spell.
    #[arg(long, env = "TESSERA_RATE_LIMIT_BURST", default_value_t = 20)]
    pub rate_limit_burst: u32,
    /// Seconds of an organization's observed spend one budget lease covers: this
    /// control plane admits that organization's credit requests against the lease in
    /// memory, writing only settlements (in batches) and renewals. 0 takes a hold in
    /// the database for every request instead.
    #[arg(long, env = "TESSERA_BUDGET_LEASE_SECS", default_value_t = 2.0)]
    pub budget_lease_secs: f64,
    /// Seconds a budget lease may go unused before it returns to its organization.
    #[arg(long, env = "TESSERA_BUDGET_LEASE_IDLE_SECS", default_value_t = 2.0)]
    pub budget_lease_idle_secs: f64,
    /// Seconds between refreshes of each model's supply state (subscription discount).
    #[arg(long, env = "TESSERA_SUPPLY_REFRESH_SECS", default_value_t = 600)]
    pub supply_refresh_secs: u64,
    /// Seconds between refreshes of GET /status's figures (and writes of this process's
    /// counts to the database).
    #[arg(long, env = "TESSERA_STATUS_REFRESH_SECS", default_value_t = 10)]
    pub status_refresh_secs: u64,
    /// How each request picks among a model's replicas: by prefix cache and load, or in
    /// turn (a baseline for comparison).
    #[arg(long, value_enum, default_value_t = Routing::CacheAware)]
    pub routing: Routing,
    /// Disaggregated serving: a prompt with fewer tokens than this that the chosen
    /// decode replica lacks is computed there rather than handed over from a prefill
    /// replica (its transfer and the prefill queue would cost more than they save).
    #[arg(long, default_value_t = crate::router::pool::HANDOFF_MIN_TOKENS)]
    pub disaggregation_min_prompt_tokens: usize,
    /// Record no metrics (GET /metrics answers 404; `tessera serve`'s workers record
    /// none either): the baseline for measuring what metrics cost.
    #[arg(long)]
    pub no_metrics: bool,
    /// Reasoning tokens a completion may spend, for models whose catalog entry names no
    /// `thinking_budget` (a request's own budget comes first); absent: no limit.
    #[arg(long, env = "TESSERA_THINKING_BUDGET")]
    pub thinking_budget: Option<u32>,
    #[command(flatten)]
    pub images: ImageArgs,
    #[command(flatten)]
    pub console: ConsoleArgs,
}

impl ApiArgs {
    /// Every setting at its default (and the environment's `TESSERA_*`): for an API
    /// embedded in another program, or a test's.
    pub fn defaults() -> Self {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            api: ApiArgs,
        }
        Only::try_parse_from(["tessera"]).expect("the environment's TESSERA_* settings are valid").api
    }
}

/// How image parts are fetched and what they may be (docs/api.md, Images).
#[derive(Args, Clone, Debug)]
pub struct ImageArgs {
    /// Largest image file a request may name or carry, in megabytes.
    #[arg(long, env = "TESSERA_IMAGE_MAX_MB", default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub image_max_mb: u32,
    /// Seconds an image fetch may take, connection included.
    #[arg(long, env = "TESSERA_IMAGE_FETCH_TIMEOUT_SECS", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=600))]
    pub image_fetch_timeout_secs: u64,
    /// Redirects an image fetch follows.
    #[arg(long, env = "TESSERA_IMAGE_MAX_REDIRECTS", default_value_t = 3)]
    pub image_max_redirects: usize,
    /// Fetch images from loopback, private and link-local addresses too. Off by default:
    /// clients must not reach this server's own network through it (SSRF).
    #[arg(long, env = "TESSERA_IMAGE_ALLOW_INTERNAL")]
    pub image_allow_internal: bool,
    /// Images (or video frames) one request may carry.
    #[arg(long, env = "TESSERA_MAX_IMAGES", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_images: u32,
}

impl ImageArgs {
    pub fn config(&self) -> crate::images::ImageConfig {
        crate::images::ImageConfig {
            max_bytes: self.image_max_mb as usize * 1_000_000,
            timeout: std::time::Duration::from_secs(self.image_fetch_timeout_secs),
            max_redirects: self.image_max_redirects,
            allow_internal: self.image_allow_internal,
            max_images: self.max_images as usize,
            ..Default::default()
        }
    }
}

/// The web console's settings (docs/console.md).
#[derive(Args, Clone, Debug)]
pub struct ConsoleArgs {
    /// The console's address as browsers reach it, which e-mails link to (default: the
    /// listen address over http).
    #[arg(long, env = "TESSERA_CONSOLE_URL")]
    pub console_url: Option<String>,
    /// Sends e-mail (invites) through this server: smtp://[user:password@]host[:port].
    /// Without it, messages are written to <data-dir>/outbox/ as .eml files.
    #[arg(long, env = "TESSERA_SMTP_URL")]
    pub smtp_url: Option<String>,
    #[arg(long, env = "TESSERA_SMTP_FROM", default_value = "Tessera <noreply@localhost>")]
    pub smtp_from: String,
    /// How long an invite's link works.
    #[arg(long, env = "TESSERA_INVITE_TTL_DAYS", default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..=90))]
    pub invite_ttl_days: u32,
    /// A console session ends after this long without a request.
    #[arg(long, env = "TESSERA_SESSION_IDLE_MINUTES", default_value_t = 120, value_parser = clap::value_parser!(u32).range(1..))]
    pub session_idle_minutes: u32,
    /// A console session ends this long after sign-in, however active.
    #[arg(long, env = "TESSERA_SESSION_MAX_HOURS", default_value_t = 24, value_parser = clap::value_parser!(u32).range(1..))]
    pub session_max_hours: u32,
    /// The sign-in throttle reads the client's address from the last X-Forwarded-For
    /// entry: set it only behind a reverse proxy that appends one.
    #[arg(long, env = "TESSERA_TRUST_FORWARDED_FOR")]
    pub trust_forwarded_for: bool,
    /// The operators' address that each dedicated-capacity request is e-mailed to.
    #[arg(long, env = "TESSERA_CAPACITY_REQUESTS_TO")]
    pub capacity_requests_to: Option<String>,
}

impl ConsoleArgs {
    /// The console URL e-mails and printed links use.
    pub fn url(&self, listen: &str) -> String {
        self.console_url.clone().unwrap_or_else(|| format!("http://{listen}")).trim_end_matches('/').to_string()
    }
}

#[derive(Subcommand)]
pub enum OrgsCommand {
    /// Creates an organization and prints its id.
    Create {
        name: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// Sets an organization's requests per minute (every control plane, next request).
    SetRateLimit {
        /// Organization id or name.
        org: String,
        #[arg(long, required_unless_present = "default", conflicts_with = "default")]
        rpm: Option<u32>,
        /// Back to the server's default.
        #[arg(long)]
        default: bool,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// Sets an organization's scheduling weight: its share of each replica's batch
    /// relative to other organizations' while they contend (default 1, for everyone;
    /// every control plane, within seconds).
    SetWeight {
        /// Organization id or name.
        org: String,
        #[arg(long, required_unless_present = "default", conflicts_with = "default",
              value_parser = clap::value_parser!(u32).range(1..=crate::weights::MAX_WEIGHT as i64))]
        weight: Option<u32>,
        /// Back to the default weight.
        #[arg(long)]
        default: bool,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum KeysCommand {
    /// Creates a key; its secret is printed this once and never again.
    Create {
        /// Organization id or name.
        #[arg(long)]
        org: String,
        #[arg(long)]
        name: String,
        #[arg(long, visible_alias = "billing", value_enum, default_value_t = BillingMode::Credits)]
        billing_mode: BillingMode,
        /// For subscription keys: draw prepaid credits when the subscription cannot pay.
        #[arg(long, visible_alias = "fallback")]
        fallback_to_credits: bool,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// Revokes a key; requests with it fail from the next one on.
    Revoke {
        key_id: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// Lists an organization's keys (never their secrets).
    List {
        #[arg(long)]
        org: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum CreditsCommand {
    /// Adds credit to an organization (recorded in the ledger as a grant).
    Grant {
        /// Organization id or name.
        #[arg(long)]
        org: String,
        /// US dollars, e.g. 25 or 0.50.
        #[arg(long)]
        usd: f64,
        /// Why, kept with the grant.
        #[arg(long, default_value = "operator grant")]
        memo: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// Buys credit for an organization through the payment processor (one-time
    /// methods such as pm_dev_crypto are accepted).
    Buy {
        #[arg(long)]
        org: String,
        #[arg(long)]
        usd: f64,
        #[arg(long, default_value = crate::billing::payments::DEV_CARD)]
        payment_method: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// An organization's spendable balance and the credit its requests in flight hold.
    Show {
        #[arg(long)]
        org: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum UsageCommand {
    /// An organization's usage records, newest first.
    List {
        #[arg(long)]
        org: String,
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum CapacityCommand {
    /// Every request (or one organization's), newest first.
    List {
        #[arg(long)]
        org: Option<String>,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// One request in full.
    Show {
        id: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// Moves a request along: received, in_review, quoted, closed.
    SetStatus {
        id: String,
        #[arg(value_enum)]
        status: crate::capacity::RequestStatus,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum UsersCommand {
    /// Creates a person and their personal organization (whose keys may be billed to
    /// their plan).
    Create {
        email: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// Sets a user's console password: read from standard input with
    /// --password-stdin, else a one-time link (valid 24 hours) is printed for them.
    SetPassword {
        email: String,
        #[arg(long)]
        password_stdin: bool,
        /// Where the link points (the console's address).
        #[arg(long, env = "TESSERA_CONSOLE_URL", default_value = "http://127.0.0.1:8080")]
        console_url: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum PlansCommand {
    /// Starts a plan, paid now with a recurring payment method.
    Start {
        /// User id or e-mail address.
        #[arg(long)]
        user: String,
        #[arg(long, value_enum)]
        plan: Plan,
        #[arg(long, default_value = crate::billing::payments::DEV_CARD)]
        payment_method: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// Changes a plan: upgrades now (pro-rated), downgrades at the next period.
    Change {
        #[arg(long)]
        user: String,
        #[arg(long, value_enum)]
        plan: Plan,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
    /// A user's plan, its included usage and windows.
    Show {
        #[arg(long)]
        user: String,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum SupplyCommand {
    /// The state in effect for each model, and each model's states over the last hours.
    Show {
        /// Hours of history to list.
        #[arg(long, default_value_t = 24)]
        hours: u32,
        #[command(flatten)]
        store: StoreArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum NodesCommand {
    /// Every live node: state, devices, labels, cordon and drain, replica count.
    List {
        #[command(flatten)]
        etcd: EtcdArgs,
        #[arg(long)]
        json: bool,
    },
    /// Places nothing new on a node (what runs there stays).
    Cordon {
        node: String,
        #[command(flatten)]
        etcd: EtcdArgs,
        #[arg(long)]
        json: bool,
    },
    /// Undoes cordon and drain.
    Uncordon {
        node: String,
        #[command(flatten)]
        etcd: EtcdArgs,
        #[arg(long)]
        json: bool,
    },
    /// Moves a node's replicas elsewhere, each leaving once its replacement is ready.
    Drain {
        node: String,
        #[command(flatten)]
        etcd: EtcdArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum DeploymentsCommand {
    /// Writes the `[[deployment]]` tables of a TOML file (model, replicas,
    /// tensor_parallel, constraints).
    Apply {
        file: PathBuf,
        #[command(flatten)]
        etcd: EtcdArgs,
        #[arg(long)]
        json: bool,
    },
    List {
        #[command(flatten)]
        etcd: EtcdArgs,
        #[arg(long)]
        json: bool,
    },
    /// Sets a deployed model's replica count (and its prefill and decode pools').
    Scale {
        model: String,
        replicas: u32,
        /// Replicas that only compute prompts (disaggregated serving); unchanged when
        /// not given.
        #[arg(long)]
        prefill: Option<u32>,
        /// Replicas that decode what prefill replicas hand over; unchanged when not given.
        #[arg(long)]
        decode: Option<u32>,
        #[command(flatten)]
        etcd: EtcdArgs,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum ReplicasCommand {
    /// Every replica: model, node, state, devices, address and live load.
    List {
        #[command(flatten)]
        etcd: EtcdArgs,
        #[arg(long)]
        json: bool,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_speculative_overrides_the_catalog_or_follows_it() {
        let ngram4 = Some(SpecConfig { method: SpecMethod::Ngram, max_tokens: 4, draft: None });
        assert_eq!(Speculative::parse("catalog").unwrap().apply(ngram4.clone()), ngram4);
        assert_eq!(Speculative::parse("off").unwrap().apply(ngram4.clone()), None);
        let every = Speculative::parse("ngram").unwrap();
        assert_eq!(every.apply(ngram4.clone()), ngram4);
        assert_eq!(
            every.apply(None),
            Some(SpecConfig { method: SpecMethod::Ngram, max_tokens: DEFAULT_SPEC_TOKENS, draft: None })
        );
        // A draft model replaced by n-grams for the whole server: the draft goes too.
        let draft = SpecConfig { method: SpecMethod::Draft, max_tokens: 4, draft: Some("small".into()) };
        assert_eq!(every.apply(Some(draft)).unwrap().draft, None);
        assert!(Speculative::parse("draft").unwrap_err().to_string().contains("in the catalog"));
        let err = Speculative::parse("eagle").unwrap_err().to_string();
        assert!(err.contains("unknown speculative method") && err.contains("off"), "{err}");
    }
}
