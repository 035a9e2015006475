//! `tessera-worker serve` as an operator runs it: the real binary on a free loopback
//! port, driven by a gRPC client, killed when the test ends.

use tessera_e2e::serve_worker;
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::{self as pb};

#[tokio::test]
async fn a_served_worker_streams_a_greedy_completion() {
    let (_worker, addr) = serve_worker();
    let mut client = WorkerClient::connect(format!("http://{addr}")).await.unwrap();
    let card = client.get_model_card(pb::ModelCardRequest {}).await.unwrap().into_inner();
    assert_eq!(card.model, "smollm2-135m-instruct");
    // The control plane tokenizes with the card's tokenizer; so does this test.
    let tokenizer = tokenizers::Tokenizer::from_bytes(card.tokenizer_json.as_bytes()).unwrap();
    let prompt = tokenizer.encode("1, 2, 3, 4, 5,", false).unwrap().get_ids().to_vec();
    let request = pb::GenerateRequest {
        request_id: "e2e".into(),
        prompt_token_ids: prompt,
        sampling: Some(pb::SamplingParams::default()),
        max_tokens: 6,
        ..Default::default()
    };
    let mut stream = client.generate(request).await.unwrap().into_inner();
    let mut text = String::new();
    let mut finish = 0;
    while let Some(r) = stream.message().await.unwrap() {
        text.push_str(&r.text);
        finish = r.finish_reason;
    }
    assert_eq!(text, " 6, 7,");
    assert_eq!(finish, pb::FinishReason::Length as i32);
}
