//! One worker serving one set of weights: its gRPC client and what its ModelCard says
//! about tokenizing, templating and the bytes of each token.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tessera_proto::chat_template::ChatTemplate;
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::{self as pb};
use tokenizers::Tokenizer;
use tonic::transport::{Channel, Endpoint};

/// HTTP/2 pings on every worker connection, answered by the worker's network threads
/// (not its engine): a worker that stops answering them — a frozen process, a node cut
/// off — fails its streams within `KEEP_ALIVE_INTERVAL + KEEP_ALIVE_TIMEOUT`, however
/// long its engine's steps run.
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(1);
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("cannot reach worker at {addr}: {message}")]
    Connect { addr: String, message: String },
    #[error("worker at {addr} sent an unusable model card: {message}")]
    Card { addr: String, message: String },
}

pub struct Replica {
    pub addr: String,
    pub client: WorkerClient<Channel>,
    pub card: pb::ModelCard,
    pub tokenizer: Tokenizer,
    pub template: Option<Arc<ChatTemplate>>,
    /// The bytes each token id stands for (byte-level BPE undone), for logprobs.
    token_bytes: Vec<Vec<u8>>,
}

impl Replica {
    pub async fn connect(addr: &str) -> Result<Self, ReplicaError> {
        let connect = |message: String| ReplicaError::Connect { addr: addr.to_string(), message };
        let card_err = |message: String| ReplicaError::Card { addr: addr.to_string(), message };
        let endpoint = Endpoint::from_shared(format!("http://{addr}")).map_err(|e| connect(e.to_string()))?;
        let channel = endpoint
            .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
            .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .connect()
            .await
            .map_err(|e| connect(e.to_string()))?;
        let mut client = WorkerClient::new(channel).max_decoding_message_size(tessera_proto::MAX_MESSAGE_BYTES);
        let card =
            client.get_model_card(pb::ModelCardRequest {}).await.map_err(|e| connect(e.to_string()))?.into_inner();
        let tokenizer = Tokenizer::from_bytes(card.tokenizer_json.as_bytes()).map_err(|e| card_err(e.to_string()))?;
        let template = if card.chat_template.is_empty() {
            None
        } else {
            Some(Arc::new(
                ChatTemplate::new(&card.chat_template, &card.bos_token, &card.eos_token)
                    .map_err(|e| card_err(e.to_string()))?,
            ))
        };
        let token_bytes = token_bytes(&tokenizer, &card.tokenizer_json);
        Ok(Self { addr: addr.to_string(), client, card, tokenizer, template, token_bytes })
    }

    /// Token ids the model accepts: its embedding rows (the tokenizer may know more).
    pub fn vocab_size(&self) -> u32 {
        if self.card.vocab_size > 0 { self.card.vocab_size } else { self.token_bytes.len() as u32 }
    }

    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map_or(&[], |b| b.as_slice())
    }

    /// The token's text as logprobs show it (invalid UTF-8 of a partial character
    /// replaced; `token_bytes` has the exact bytes).
    pub fn token_text(&self, id: u32) -> String {
        String::from_utf8_lossy(self.token_bytes(id)).into_owned()
    }
}

/// Each token's bytes: byte-level BPE vocabularies spell bytes as printable characters
/// (GPT-2's table), which are mapped back; other tokenizers decode each token alone.
fn token_bytes(tokenizer: &Tokenizer, json: &str) -> Vec<Vec<u8>> {
    let byte_level =
        serde_json::from_str::<serde_json::Value>(json).ok().is_some_and(|v| v["decoder"]["type"] == "ByteLevel");
    let unbyte = byte_level_table();
    let size = tokenizer.get_vocab_size(true) as u32;
    (0..size)
        .map(|id| {
            let Some(piece) = tokenizer.id_to_token(id) else { return Vec::new() };
            let is_special = tokenizer.get_added_vocabulary().is_special_token(&piece);
            if byte_level
                && !is_special
                && let Some(bytes) = piece.chars().map(|c| unbyte.get(&c).copied()).collect::<Option<Vec<u8>>>()
            {
                return bytes;
            }
            if is_special {
                return piece.into_bytes();
            }
            tokenizer.decode(&[id], false).map(String::into_bytes).unwrap_or_default()
        })
        .collect()
}

/// GPT-2's byte ↔ printable character table, inverted.
fn byte_level_table() -> HashMap<char, u8> {
    let printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut table = HashMap::new();
    let mut extra = 0;
    for b in 0..=255u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        table.insert(char::from_u32(c).expect("valid char"), b as u8);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_level_table_inverts_gpt2s() {
        let t = byte_level_table();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'Ġ'], b' ');
        assert_eq!(t[&'Ċ'], b'\n');
        assert_eq!(t[&'a'], b'a');
    }
}
