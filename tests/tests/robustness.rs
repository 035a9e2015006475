//! One request never takes a replica down: against a single-replica `tessera serve` with
//! a 64 MiB KV cache (1,456 tokens of SmolLM2, less than its 8,192-token context), a
//! request the cache cannot hold is refused at once and the next one is served; and
//! sixteen clients sending a mix of long prompts, long generations, abandoned streams
//! and malformed bodies for two minutes (`TESSERA_SOAK_SECS`), which keeps both cores of
//! the machine busy and some engine steps seconds long, get no 503, no hang, and every
//! answer in the API's shape. Driven by the official `openai` SDK, with raw HTTP for
//! what the SDK would not send.

use serde_json::Value;
use tessera_e2e::{Serve, get, python, until};

/// The SDK's view of the oversized case, printed as JSON.
const OVERSIZED: &str = r#"
import json, os, time, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0, timeout=60)
out = {}
model = c.models.retrieve("vendor-c/model-c")
out["context_length"] = model.context_length
out["max_model_len"] = model.max_model_len
long = [{"role": "user", "content": "word " * 1360}]
began = time.monotonic()
try:
    c.chat.completions.create(model="vendor-c/model-c", messages=long, max_tokens=400)
    out["oversized"] = "answered"
except openai.BadRequestError as e:
    out["oversized"] = {"status": e.status_code, "code": e.code, "param": e.param, "message": e.message}
out["oversized_secs"] = time.monotonic() - began
# Greedy, and a question whose answer is longer than four tokens: a sampled reply to "Hi" may end sooner.
r = c.chat.completions.create(model="vendor-c/model-c", max_tokens=4, temperature=0,
                              messages=[{"role": "user", "content": "Count from one to twenty in words."}])
out["next"] = {"finish_reason": r.choices[0].finish_reason, "completion_tokens": r.usage.completion_tokens}
# No max_tokens: the default is what the context leaves.
r = c.chat.completions.create(model="vendor-c/model-c", messages=long, temperature=0)
out["default"] = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                  "finish_reason": r.choices[0].finish_reason}
try:
    c.completions.create(model="vendor-c/model-c", prompt="word " * 1300, max_tokens=400)
    out["legacy"] = "answered"
except openai.BadRequestError as e:
    out["legacy"] = {"code": e.code, "param": e.param}
print(json.dumps(out))
"#;

#[test]
fn a_request_the_cache_cannot_hold_is_refused_at_once_and_the_replica_serves_the_next() {
    let data = tempfile::tempdir().unwrap();
    // 32 MiB hold 1,456 tokens of SmolLM2's half-float K/V: less than its 8,192.
    let serve = Serve::start(data.path(), &["--kv-cache-bytes", "33554432"], &[]);
    let out = python(OVERSIZED, &serve.base_url(), &serve.key, &[]).output().unwrap();
    assert!(out.status.success(), "the SDK client failed: {}", String::from_utf8_lossy(&out.stderr));
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    // The usable context is what the cache holds, and /v1/models says so.
    assert_eq!((got["context_length"].as_u64(), got["max_model_len"].as_u64()), (Some(1456), Some(1456)), "{got}");
    let refused = &got["oversized"];
    assert_eq!((refused["status"].as_u64(), refused["code"].as_str()), (Some(400), Some("context_length_exceeded")));
    assert_eq!(refused["param"], "messages");
    assert!(refused["message"].as_str().unwrap().contains("maximum context length is 1456 tokens"), "{refused}");
    // Refused before it ran: a generation of 400 tokens takes longer than this.
    assert!(got["oversized_secs"].as_f64().unwrap() < 20.0, "{got}");
    assert_eq!(got["next"]["finish_reason"], "length");
    assert_eq!(got["next"]["completion_tokens"], 4);
    let default = &got["default"];
    let (prompt, completion) =
        (default["prompt_tokens"].as_u64().unwrap(), default["completion_tokens"].as_u64().unwrap());
    assert!(prompt > 1300 && prompt + completion <= 1456, "{default}");
    assert_eq!(got["legacy"]["code"], "context_length_exceeded");
    assert_eq!(got["legacy"]["param"], "prompt");
}

/// Sixteen clients for `SOAK_SECS`; prints a JSON summary: outcomes by kind and status,
/// and every problem (a 5xx, a hang, an answer out of shape).
const SOAK: &str = r#"
import http.client, json, os, random, threading, time, urllib.parse, openai

BASE, KEY = os.environ["BASE"], os.environ["KEY"]
SECS = float(os.environ["SOAK_SECS"])
HANG = 300.0
MODELS = ["vendor-c/model-c", "vendor-a/model-a"]
c = openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=HANG)
CONTEXT = c.models.retrieve(MODELS[0]).context_length
WORDS = "the sea river city cloud stone light garden music winter road paper tide".split()

lock = threading.Lock()
outcomes, problems, latencies = {}, [], []

def note(kind, status, problem=None, secs=None):
    with lock:
        by = outcomes.setdefault(kind, {})
        by[str(status)] = by.get(str(status), 0) + 1
        if problem:
            problems.append(f"{kind} ({status}): {problem}"[:400])
        if secs is not None:
            latencies.append(secs)

def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))

def shaped_error(body):
    e = body.get("error") if isinstance(body, dict) else None
    return isinstance(e, dict) and all(k in e for k in ("message", "type", "param", "code")) and e["message"]

def check(kind, r, n=1):
    if len(r.choices) != n or any(ch.finish_reason not in ("stop", "length") for ch in r.choices):
        return f"choices {r.choices}"
    u = r.usage
    if u is None or u.completion_tokens > n * (CONTEXT - u.prompt_tokens):
        return f"usage {u}"

def chat(kind, rng, **kw):
    kw.setdefault("model", rng.choice(MODELS))
    began = time.monotonic()
    r = c.chat.completions.create(**kw)
    note(kind, 200, check(kind, r, kw.get("n", 1)), time.monotonic() - began)

def streamed(kind, rng, abandon):
    began = time.monotonic()
    s = c.chat.completions.create(model=rng.choice(MODELS), stream=True, max_tokens=rng.randint(20, 150),
                                  messages=[{"role": "user", "content": "Tell me about the " + text(rng, 3)}])
    finish, chunks = None, 0
    for chunk in s:
        chunks += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if abandon and chunks == 3:
            s.close()
            note(kind, 200, None, time.monotonic() - began)
            return
    note(kind, 200, None if finish in ("stop", "length") else f"stream ended without a finish ({chunks} chunks)",
         time.monotonic() - began)

def raw(kind, body):
    u = urllib.parse.urlparse(BASE)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=HANG)
    conn.request("POST", u.path + "/chat/completions", body=body,
                 headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        parsed = json.loads(data)
    except ValueError:
        parsed = None
    problem = None
    if not 400 <= resp.status < 500 or resp.status == 429:
        problem = f"a malformed body got {resp.status}"
    elif not shaped_error(parsed):
        problem = f"error out of shape: {data[:200]!r}"
    note(kind, resp.status, problem)

MALFORMED = [
    b"{not json", b"", b"[1, 2]", b'"text"',
    json.dumps({"model": "vendor-c/model-c"}).encode(),
    json.dumps({"model": "no/such-model", "messages": [{"role": "user", "content": "x"}]}).encode(),
    json.dumps({"model": "vendor-c/model-c", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}).encode(),
    json.dumps({"model": "vendor-c/model-c", "messages": [{"role": "user", "content": "x"}], "temperature": 9}).encode(),
    json.dumps({"model": "vendor-c/model-c", "messages": []}).encode(),
    json.dumps({"model": "vendor-c/model-c", "messages": [{"role": "user", "content": "x"}], "n": 0}).encode(),
    json.dumps({"model": "vendor-c/model-c", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}).encode(),
    json.dumps({"model": "vendor-c/model-c", "messages": [{"role": "wizard", "content": "x"}]}).encode(),
    json.dumps({"model": "vendor-c/model-c", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(),
    json.dumps({"model": "vendor-c/model-c", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}).encode(),
]

def one(rng):
    kind = rng.choices(["malformed", "short", "long_prompt", "long_generation", "no_max_tokens", "n2",
                        "oversized", "streamed", "abandoned"], [30, 15, 14, 10, 6, 5, 6, 8, 6])[0]
    try:
        if kind == "malformed":
            raw(kind, rng.choice(MALFORMED))
        elif kind == "short":
            chat(kind, rng, max_tokens=rng.randint(1, 32), messages=[{"role": "user", "content": text(rng, 5)}])
        elif kind == "long_prompt":
            n = rng.randint(500, min(1300, CONTEXT - 150))
            chat(kind, rng, max_tokens=8, messages=[{"role": "user", "content": text(rng, n)}])
        elif kind == "long_generation":
            chat(kind, rng, max_tokens=rng.randint(100, 300), temperature=1.0,
                 messages=[{"role": "user", "content": "Write a long story about the " + text(rng, 2)}])
        elif kind == "no_max_tokens":
            # A long prompt: the default is what the context leaves.
            n = rng.randint(CONTEXT - 400, CONTEXT - 150)
            chat(kind, rng, messages=[{"role": "user", "content": text(rng, n)}])
        elif kind == "n2":
            chat(kind, rng, n=2, max_tokens=24, messages=[{"role": "user", "content": text(rng, 8)}])
        elif kind == "oversized":
            try:
                chat(kind, rng, max_tokens=400, messages=[{"role": "user", "content": text(rng, CONTEXT - 100)}])
                note(kind, 200, "an oversized request was answered")
            except openai.BadRequestError as e:
                note(kind, 400, None if e.code == "context_length_exceeded" else f"code {e.code}")
        else:
            streamed(kind, rng, kind == "abandoned")
    except openai.APITimeoutError:
        note(kind, "timeout", f"no answer in {HANG} s")
    except openai.APIStatusError as e:
        body = {"error": e.body} if isinstance(e.body, dict) else e.body
        client_error = 400 <= e.status_code < 500 and e.status_code != 429 and kind != "oversized"
        note(kind, e.status_code, None if client_error and shaped_error(body) else f"{e.status_code}: {e.message}")
    except Exception as e:
        note(kind, "exception", repr(e))

def client(i, end):
    rng = random.Random(i)
    while time.monotonic() < end:
        one(rng)

began = time.monotonic()
end = began + SECS
threads = [threading.Thread(target=client, args=(i, end)) for i in range(16)]
for t in threads:
    t.start()
for t in threads:
    t.join()
# The replica is still whole: a small request answers.
r = c.chat.completions.create(model=MODELS[0], messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
latencies.sort()
print(json.dumps({"secs": round(time.monotonic() - began, 1), "context": CONTEXT, "outcomes": outcomes,
                  "answered": sum(sum(v.values()) for v in outcomes.values()),
                  "p50_s": latencies[len(latencies) // 2] if latencies else None,
                  "max_s": latencies[-1] if latencies else None,
                  "after": r.choices[0].finish_reason, "problems": problems}))
"#;

#[test]
fn sixteen_clients_mixing_long_and_malformed_requests_get_no_503_and_no_hang() {
    let data = tempfile::tempdir().unwrap();
    // The clients' own rate would be refused at the default 200 a minute.
    let serve = Serve::start(data.path(), &["--rate-limit-rpm", "1000000", "--rate-limit-burst", "100000"], &[]);
    let secs = std::env::var("TESSERA_SOAK_SECS").unwrap_or_else(|_| "120".into());
    let out = python(SOAK, &serve.base_url(), &serve.key, &[("SOAK_SECS", secs)]).output().unwrap();
    assert!(out.status.success(), "the soak failed: {}", String::from_utf8_lossy(&out.stderr));
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("{summary}");
    assert_eq!(summary["problems"], Value::Array(Vec::new()), "{summary:#}");
    // The replica still answers afterwards (two tokens, or fewer if the model ends).
    assert!(["stop", "length"].contains(&summary["after"].as_str().unwrap_or("")), "{summary}");
    // Every kind of request was sent, and each had answers of the kind expected.
    let outcomes = &summary["outcomes"];
    for kind in ["short", "long_prompt", "long_generation", "no_max_tokens", "n2", "streamed", "abandoned"] {
        assert!(outcomes[kind]["200"].as_u64().unwrap_or(0) > 0, "no {kind} request answered: {summary}");
    }
    assert!(outcomes["oversized"]["400"].as_u64().unwrap_or(0) > 0, "{summary}");
    assert!(outcomes["malformed"].as_object().is_some_and(|m| !m.is_empty()), "{summary}");
}

/// Sequential requests, each with `TIMEOUT` seconds to answer; prints how many did.
const SEQUENTIAL: &str = r#"
import os, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0, timeout=30)
done = 0
for i in range(6):
    r = c.chat.completions.create(model="vendor-c/model-c", messages=[{"role": "user", "content": f"Hi {i}"}],
                                  max_tokens=2)
    done += r.choices[0].finish_reason in ("stop", "length")
print(done)
"#;

#[test]
fn a_frozen_replica_leaves_routing_within_seconds() {
    // Two replicas taking turns; one stops (SIGSTOP: its connections stay open and
    // silent, as a node cut off would). A request sent to it fails over once the
    // connection's keep-alive gives up on it, and later ones go to the other.
    let data = tempfile::tempdir().unwrap();
    let serve = Serve::start(data.path(), &["--replicas", "2", "--routing", "round-robin"], &[]);
    let children =
        std::process::Command::new("pgrep").args(["-P", &serve.process.0.id().to_string()]).output().unwrap();
    let workers: Vec<String> =
        String::from_utf8(children.stdout).unwrap().split_whitespace().map(String::from).collect();
    assert_eq!(workers.len(), 2, "two local workers: {workers:?}");
    let signal = |sig: &str| {
        let status = std::process::Command::new("kill").args([sig, &workers[0]]).status().unwrap();
        assert!(status.success());
    };
    signal("-STOP");
    let out = python(SEQUENTIAL, &serve.base_url(), &serve.key, &[]).output().unwrap();
    signal("-CONT");
    assert!(out.status.success(), "a request failed or hung: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap().trim(), "6");
}

/// One greedy prompt three ways: handed over (n = 1), streamed, and whole (n = 2 is
/// never disaggregated); prints the texts.
const THREE_WAYS: &str = r#"
import os, json, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0, timeout=60)
messages = [{"role": "user", "content": "Write three sentences about the sea, with a number in each. " * 6}]
kw = dict(model="vendor-c/model-c", messages=messages, max_tokens=24, temperature=0)
handed = c.chat.completions.create(**kw)
streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw) if ch.choices)
whole = c.chat.completions.create(n=2, **kw)
print(json.dumps({"handed": handed.choices[0].message.content, "streamed": streamed,
                  "whole": whole.choices[0].message.content, "usage": handed.usage.completion_tokens}))
"#;

#[test]
fn disaggregated_serving_answers_as_one_replica_would() {
    // A prefill worker and a decode worker: each n = 1 request's prompt is computed on
    // the first, its KV blocks sent to the second, which goes on from the first token.
    let data = tempfile::tempdir().unwrap();
    // (Prompts of 16 tokens on are handed over: this one's ~80 would be computed where
    // it decodes by default.)
    let args = ["--prefill-replicas", "1", "--decode-replicas", "1", "--disaggregation-min-prompt-tokens", "16"];
    let serve = Serve::start(data.path(), &args, &[]);
    let out = python(THREE_WAYS, &serve.base_url(), &serve.key, &[]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let texts: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!texts["handed"].as_str().unwrap().is_empty(), "{texts}");
    assert_eq!(texts["handed"], texts["whole"], "{texts}");
    assert_eq!(texts["streamed"], texts["whole"], "{texts}");
    assert_eq!(texts["usage"], 24, "{texts}");
    // The first was handed over with its blocks. (The second too, unless the decode
    // worker's report that it holds the prompt now came first: then it computed the
    // few tokens it lacked itself.)
    let metrics = serve.get("/metrics").unwrap();
    let handed = metrics
        .lines()
        .find(|l| l.starts_with("tessera_handoffs_total") && l.contains("outcome=\"transferred\""))
        .unwrap_or_else(|| panic!("no handoff counted:\n{metrics}"));
    assert!(handed.ends_with(" 1") || handed.ends_with(" 2"), "{handed}");
    // The workers counted it too (what the Capacity dashboard's handoff panels read):
    // the prefill worker's sent bytes arrived whole at the decode worker, and the
    // handoff and its time were recorded. (Each side records it through its engine's queue:
    // read until both have.)
    let workers: Vec<&str> = serve
        .started
        .iter()
        .filter(|l| l.contains("tessera-worker serving"))
        .map(|l| l.rsplit(" on ").next().unwrap())
        .collect();
    let counted = || {
        let (mut sent, mut received, mut timed, mut handoffs) = (0.0, 0.0, 0.0, 0.0);
        for w in &workers {
            let text = get(&format!("http://{w}/metrics"))?;
            sent += series_sum(&text, "tessera:kv_transfer_bytes_total{", "direction=\"sent\"");
            received += series_sum(&text, "tessera:kv_transfer_bytes_total{", "direction=\"received\"");
            timed += series_sum(&text, "tessera:kv_transfer_seconds_count", "");
            handoffs += series_sum(&text, "tessera:kv_transfers_total{", "outcome=\"sent\"");
        }
        Some((sent, received, timed.min(handoffs)))
    };
    assert_eq!(workers.len(), 2, "{:?}", serve.started);
    until(10, "bytes sent by the prefill worker, all received by the decode worker, the transfer timed", || {
        counted().filter(|&(sent, received, timed)| sent > 0.0 && sent == received && timed >= 1.0)
    });

    // The prefill worker killed as its first token reaches the client (its blocks on
    // their way): the request goes on at the decode worker, which computes what it
    // lacks, and ends with all its tokens.
    let [prefill, _] = workers_by_role(&serve);
    let done = kill_at_first_token(&serve, &prefill);
    assert_eq!((done["finish"].as_str(), done["completion_tokens"].as_u64()), (Some("length"), Some(24)), "{done}");

    // The decode worker killed the same way, on a second pair: the request goes on at
    // the prefill worker, resumed after its first token.
    let data = tempfile::tempdir().unwrap();
    let serve = Serve::start(data.path(), &args, &[]);
    let [_, decode] = workers_by_role(&serve);
    let done = kill_at_first_token(&serve, &decode);
    assert_eq!((done["finish"].as_str(), done["completion_tokens"].as_u64()), (Some("length"), Some(24)), "{done}");
}

/// The sum of the series in Prometheus text `text` whose lines start with `name` and
/// hold `label`.
fn series_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `tessera serve`'s prefill worker and decode worker, by their command lines.
fn workers_by_role(serve: &Serve) -> [String; 2] {
    let children =
        std::process::Command::new("pgrep").args(["-P", &serve.process.0.id().to_string()]).output().unwrap();
    let pids: Vec<String> = String::from_utf8(children.stdout).unwrap().split_whitespace().map(String::from).collect();
    let role = |pid: &String| std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap().replace('\0', " ");
    let find = |mode: &str| {
        pids.iter()
            .find(|p| role(p).contains(&format!("--disaggregation-mode {mode}")))
            .cloned()
            .unwrap_or_else(|| panic!("no {mode} worker among {pids:?}"))
    };
    [find("prefill"), find("decode")]
}

/// Streams a long greedy request, SIGKILLs `pid` as its first token arrives, and
/// returns how the stream ended (finish reason, completion tokens).
fn kill_at_first_token(serve: &Serve, pid: &str) -> Value {
    use std::io::BufRead;
    let mut client = python(KILLED_MID_STREAM, &serve.base_url(), &serve.key, &[]).spawn().unwrap();
    let mut out = std::io::BufReader::new(client.stdout.take().unwrap()).lines();
    assert_eq!(out.next().unwrap().unwrap(), "FIRST");
    let killed = std::process::Command::new("kill").args(["-KILL", pid]).status().unwrap();
    assert!(killed.success());
    let last = out.next().expect("the stream's end").unwrap();
    assert!(client.wait().unwrap().success());
    serde_json::from_str(&last).unwrap()
}

/// A streamed greedy request of a ~600-token prompt: prints FIRST at its first token,
/// then how it ended.
const KILLED_MID_STREAM: &str = r#"
import os, sys, json, openai
c = openai.OpenAI(base_url=os.environ["BASE"], api_key=os.environ["KEY"], max_retries=0, timeout=120)
text = "Summarise these notes: " + " ".join(f"note {i} says the tide was {i % 7} metres" for i in range(60))
stream = c.chat.completions.create(model="vendor-c/model-c", messages=[{"role": "user", "content": text}],
    max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
finish, usage, first = None, None, True
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content and first:
        print("FIRST", flush=True)
        first = False
    if chunk.choices and chunk.choices[0].finish_reason:
        finish = chunk.choices[0].finish_reason
    if chunk.usage:
        usage = chunk.usage.completion_tokens
print(json.dumps({"finish": finish, "completion_tokens": usage}))
"#;
