//! The replicas serving one set of weights, and which of them takes each request.
//!
//! Each member's `WatchLoad` stream keeps two things current: its load (running and
//! waiting sequences at the last report, plus the requests dispatched to it that it has
//! not answered yet, counted here at dispatch) and exactly which prompt blocks its prefix
//! cache holds (the stream opens with a snapshot, then sends changes). A member whose
//! stream breaks or falls silent leaves routing at once, its cache forgotten, and comes
//! back when a new stream opens; a member that has not reported yet is routable with no
//! load, so a fresh replica takes traffic at once.

use super::choice::{self, Candidate, PrefixIndex, Routing, Weights};
use super::replica::Replica;
use crate::metrics as m;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;
use tessera_proto::block_hash::{BLOCK_TOKENS, BlockHash, BlockHasher, ImageSpan};
use tessera_proto::worker as pb;

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("replica {id} uses KV blocks of {got} tokens; routing needs {BLOCK_TOKENS}")]
    BlockSize { id: String, got: u32 },
    #[error("replica {id} serves {got}, not {want}")]
    Model { id: String, got: String, want: String },
}

/// `Pool::handoff_min_tokens` by default: a prompt of up to 32 blocks is computed where
/// it decodes (as NVIDIA Dynamo's disaggregated router keeps short prefills local).
pub const HANDOFF_MIN_TOKENS: usize = 512;

pub struct Pool {
    /// The served model's name as the workers hash it (their cards' `model`).
    model: String,
    /// Disaggregated serving hands over prompts of at least this many tokens that the
    /// decode replica lacks; shorter ones it computes itself.
    handoff_min_tokens: usize,
    hasher: BlockHasher,
    routing: Routing,
    weights: Weights,
    /// Round-robin's next turn.
    turn: AtomicUsize,
    members: RwLock<BTreeMap<String, Arc<Member>>>,
    index: Arc<Mutex<PrefixIndex>>,
}

struct Member {
    id: String,
    /// Its part in disaggregated serving, as its card says.
    role: pb::ServingRole,
    replica: Arc<Replica>,
    load: Mutex<Load>,
    follower: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

#[derive(Default)]
struct Load {
    /// The last report; None before the first.
    report: Option<pb::LoadReport>,
    /// Requests sent that the worker has not answered yet: a report may predate them.
    unanswered: u32,
    /// The load stream is down or silent: no routing here until it reports again.
    broken: bool,
}

impl Drop for Member {
    fn drop(&mut self) {
        if let Some(f) = self.follower.lock().unwrap_or_else(|e| e.into_inner()).take() {
            f.abort();
        }
    }
}

/// Which part of a request a replica is chosen for (`Pool::choose_stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Prefill and decode.
    Whole,
    /// The prompt and first token, handed over to a decode replica.
    Prefill,
    /// The rest, after a prefill replica's handoff.
    Decode,
}

/// A request sent to a replica, counted in its load until the worker answers (the
/// first delta, or an error): then the worker's own reports count it.
pub struct Dispatch {
    member: Arc<Member>,
}

impl Dispatch {
    pub fn id(&self) -> &str {
        &self.member.id
    }

    pub fn replica(&self) -> &Arc<Replica> {
        &self.member.replica
    }
}

impl Drop for Dispatch {
    fn drop(&mut self) {
        let mut load = self.member.load.lock().unwrap_or_else(|e| e.into_inner());
        load.unanswered = load.unanswered.saturating_sub(1);
    }
}

impl Pool {
    /// The served weights' name, as the workers' cards say it.
    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn new(model: &str, routing: Routing) -> Self {
        Self {
            model: model.to_string(),
            handoff_min_tokens: HANDOFF_MIN_TOKENS,
            hasher: BlockHasher::new(model),
            routing,
            weights: Weights::default(),
            turn: AtomicUsize::new(0),
            members: RwLock::default(),
            index: Arc::default(),
        }
    }

    /// Adds a replica under `id` (replacing one of that id), after checking that its
    /// cache events can be matched against prompts hashed here.
    pub fn add(&self, id: &str, replica: Arc<Replica>) -> Result<(), PoolError> {
        let card = &replica.card;
        if card.kv_block_size as usize != BLOCK_TOKENS {
            return Err(PoolError::BlockSize { id: id.into(), got: card.kv_block_size });
        }
        if card.model != self.model {
            return Err(PoolError::Model { id: id.into(), got: card.model.clone(), want: self.model.clone() });
        }
        let role = card.role();
        let member =
            Arc::new(Member { id: id.to_string(), role, replica, load: Mutex::default(), follower: Mutex::default() });
        // Spawned once the member exists, so that the follower's first look finds it.
        let follower = tokio::spawn(follow_load(Arc::downgrade(&member), self.index.clone()));
        *member.follower.lock().unwrap_or_else(|e| e.into_inner()) = Some(follower);
        let old = self.members.write().unwrap_or_else(|e| e.into_inner()).insert(id.to_string(), member);
        if old.is_some() {
            self.index.lock().unwrap_or_else(|e| e.into_inner()).forget(id);
        }
        Ok(())
    }

    /// Takes a replica out of routing (requests already sent to it go on).
    pub fn remove(&self, id: &str) {
        self.members.write().unwrap_or_else(|e| e.into_inner()).remove(id);
        self.index.lock().unwrap_or_else(|e| e.into_inner()).forget(id);
    }

    /// A prompt's chained block hashes, as `choose` takes them (computed once per
    /// request, however many replicas it tries).
    pub fn blocks(&self, prompt: &[u32], images: &[ImageSpan]) -> Vec<BlockHash> {
        self.hasher.hash_prompt(prompt, images)
    }

    /// The replica for a whole request (prefill and decode) of these `blocks`, counted
    /// in its load while the dispatch lives; None when every routable replica is
    /// saturated or none is routable (the caller answers 503). Aggregated replicas take
    /// whole requests; without one, any replica does.
    pub fn choose(&self, blocks: &[BlockHash], except: &[String]) -> Option<Dispatch> {
        self.choose_stage(Stage::Whole, blocks, except)
    }

    /// The same, handing over prompts from `tokens` uncached tokens on
    /// (`--disaggregation-min-prompt-tokens`).
    pub fn handing_over_from(self, tokens: usize) -> Self {
        Self { handoff_min_tokens: tokens, ..self }
    }

    /// Whether a prompt of `prompt_tokens`, of which a decode replica holds `held`
    /// leading blocks (`held_by`), is worth handing over: the tokens it lacks reach the
    /// threshold.
    pub fn worth_handing_over(&self, prompt_tokens: usize, held: usize) -> bool {
        prompt_tokens.saturating_sub(held * BLOCK_TOKENS) >= self.handoff_min_tokens
    }

    /// Whether requests can be served disaggregated: the pool has a prefill replica and
    /// a decode replica, routable.
    pub fn disaggregated(&self) -> bool {
        let members = self.members.read().unwrap_or_else(|e| e.into_inner());
        let routable =
            |role| members.values().any(|m| m.role == role && !m.load.lock().unwrap_or_else(|e| e.into_inner()).broken);
        routable(pb::ServingRole::Prefill) && routable(pb::ServingRole::Decode)
    }

    /// Leading blocks of a prompt replica `id` holds, on its device or in its tier.
    pub fn held_by(&self, id: &str, blocks: &[BlockHash]) -> usize {
        let index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        index.matched(blocks).get(id).map_or(0, |m| m.device + m.tier)
    }

    /// The replica for one stage of a request: as `choose`, among the replicas of the
    /// stage's role (a whole request goes to an aggregated replica, else a decode
    /// replica, else a prefill replica).
    pub fn choose_stage(&self, stage: Stage, blocks: &[BlockHash], except: &[String]) -> Option<Dispatch> {
        use pb::ServingRole::{Aggregated, Decode, Prefill};
        match stage {
            Stage::Prefill => self.choose_among(&[Prefill], blocks, except, true),
            Stage::Decode => self.choose_among(&[Decode], blocks, except, true),
            // Without aggregated replicas, decode replicas take whole requests (prefill
            // replicas stay free for prompts) and prefill replicas only when no decode
            // replica can.
            Stage::Whole => self
                .choose_among(&[Aggregated], blocks, except, false)
                .or_else(|| self.choose_among(&[Decode], blocks, except, false))
                .or_else(|| self.choose_among(&[Prefill], blocks, except, true)),
        }
    }

    fn choose_among(
        &self,
        roles: &[pb::ServingRole],
        blocks: &[BlockHash],
        except: &[String],
        count_none: bool,
    ) -> Option<Dispatch> {
        let members = self.members.read().unwrap_or_else(|e| e.into_inner());
        let (candidates, matched) = {
            let index = self.index.lock().unwrap_or_else(|e| e.into_inner());
            let candidates: Vec<Candidate> = members
                .values()
                .filter(|m| !except.contains(&m.id) && roles.contains(&m.role))
                .filter_map(|m| {
                    let load = m.load.lock().unwrap_or_else(|e| e.into_inner());
                    let reported = load.report.as_ref().map_or(0, |r| r.running + r.waiting);
                    let (id, cached) = (m.id.clone(), index.cached(&m.id));
                    (!load.broken).then_some(Candidate { id, reported, dispatched: load.unanswered, cached })
                })
                .collect();
            (candidates, index.matched(blocks))
        };
        let picked = match self.routing {
            Routing::CacheAware => choice::choose(&candidates, blocks.len(), &matched, self.weights),
            Routing::RoundRobin => {
                choice::in_turn(&candidates, self.turn.fetch_add(1, Ordering::Relaxed), self.weights)
            }
        };
        let Some(chosen) = picked else {
            if count_none {
                metrics::counter!(m::ROUTING_DECISIONS, "model" => self.model.clone(), "outcome" => "none")
                    .increment(1);
            }
            return None;
        };
        // The router's prefix hit rate counts the device's cache, as the workers' does.
        let held = matched.get(&chosen.id).map_or(0, |m| m.device).min(blocks.len());
        let outcome = if held > 0 { "cached" } else { "uncached" };
        metrics::counter!(m::ROUTING_DECISIONS, "model" => self.model.clone(), "outcome" => outcome).increment(1);
        metrics::counter!(m::ROUTED_BLOCKS, "model" => self.model.clone()).increment(blocks.len() as u64);
        metrics::counter!(m::ROUTED_CACHED_BLOCKS, "model" => self.model.clone()).increment(held as u64);
        let member = members[&chosen.id].clone();
        member.load.lock().unwrap_or_else(|e| e.into_inner()).unanswered += 1;
        Some(Dispatch { member })
    }

    /// Marks a replica unreachable (a request to it failed to start); its load stream
    /// brings it back once it answers again.
    pub fn broken(&self, id: &str) {
        if let Some(m) = self.members.read().unwrap_or_else(|e| e.into_inner()).get(id) {
            m.load.lock().unwrap_or_else(|e| e.into_inner()).broken = true;
        }
    }

    /// The longest prompt plus completion every member takes (the least of their cards'
    /// contexts: each caps its own at what its KV cache holds); None with no member.
    pub fn context_length(&self) -> Option<u32> {
        let members = self.members.read().unwrap_or_else(|e| e.into_inner());
        members.values().map(|m| m.replica.card.context_length).min()
    }

    /// Every member's address, routable or not (for Prometheus to scrape).
    pub fn addrs(&self) -> Vec<String> {
        let members = self.members.read().unwrap_or_else(|e| e.into_inner());
        members.values().map(|m| m.replica.addr.clone()).collect()
    }

    /// Each routable replica's last load report.
    pub fn loads(&self) -> Vec<pb::LoadReport> {
        let members = self.members.read().unwrap_or_else(|e| e.into_inner());
        members
            .values()
            .filter_map(|m| {
                let load = m.load.lock().unwrap_or_else(|e| e.into_inner());
                if load.broken { None } else { load.report.clone() }
            })
            .collect()
    }

    /// Cached prompt blocks per replica, as its events say.
    pub fn cached_blocks(&self, id: &str) -> usize {
        self.index.lock().unwrap_or_else(|e| e.into_inner()).cached(id)
    }
}

/// How often workers are asked to report, and the silence after which one is taken out
/// of routing. Workers report from a thread apart from their engine, so a long step
/// does not silence them: silence means the process or the network is gone (the
/// connection's keep-alive says so too, `replica::KEEP_ALIVE_TIMEOUT`).
const REPORT_MS: u32 = 250;
const SILENCE: Duration = Duration::from_secs(4);

/// Follows a member's load stream while the member lives, reconnecting a second after
/// it breaks.
async fn follow_load(member: Weak<Member>, index: Arc<Mutex<PrefixIndex>>) {
    loop {
        let Some(m) = member.upgrade() else { return };
        let (id, mut client) = (m.id.clone(), m.replica.client.clone());
        drop(m);
        if let Ok(stream) = client.watch_load(pb::WatchLoadRequest { interval_ms: REPORT_MS }).await {
            let mut stream = stream.into_inner();
            // A worker that stops reporting without closing the connection (a node that
            // lost power or network) is as gone as one whose stream broke.
            while let Ok(Ok(Some(report))) = tokio::time::timeout(SILENCE, stream.message()).await {
                if !apply(&member, &index, &id, report) {
                    return;
                }
            }
        }
        {
            let Some(m) = member.upgrade() else { return };
            index.lock().unwrap_or_else(|e| e.into_inner()).forget(&id);
            let mut load = m.load.lock().unwrap_or_else(|e| e.into_inner());
            load.broken = true;
            load.report = None;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// One report into the member's load and the prefix index; false once the member is gone.
fn apply(member: &Weak<Member>, index: &Mutex<PrefixIndex>, id: &str, report: pb::LoadReport) -> bool {
    let Some(m) = member.upgrade() else { return false };
    {
        let mut ix = index.lock().unwrap_or_else(|e| e.into_inner());
        // Each block is in one list, the one that says where it is now.
        let tier = [&report.host_block_hashes[..], &report.disk_block_hashes[..]].concat();
        if report.snapshot {
            ix.reset(id, &report.stored_block_hashes, &tier);
        } else {
            ix.store(id, &report.stored_block_hashes);
            ix.store_in_tier(id, &tier);
            ix.remove(id, &report.removed_block_hashes);
        }
    }
    let mut load = m.load.lock().unwrap_or_else(|e| e.into_inner());
    load.broken = false;
    if !report.snapshot {
        load.report = Some(report);
    }
    true
}
