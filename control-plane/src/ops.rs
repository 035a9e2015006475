//! Operator commands: organizations and keys straight in the store, JSON with `--json`.

use crate::accounts::{NewKey, Store};
use crate::config::{KeysCommand, OrgsCommand, StoreArgs};
use anyhow::Result;
use serde_json::json;

async fn open(store: &StoreArgs) -> Result<Store> {
    std::fs::create_dir_all(&store.data_dir)?;
    Ok(Store::open(&store.database_url()).await?)
}

fn print(json_out: bool, value: serde_json::Value, human: String) {
    if json_out {
        println!("{value}");
    } else {
        println!("{human}");
    }
}

pub async fn orgs(cmd: OrgsCommand) -> Result<()> {
    match cmd {
        OrgsCommand::Create { name, store, json } => {
            let org = open(&store).await?.create_org(&name).await?;
            print(json, json!(org), format!("created organization {} ({})", org.id, org.name));
        }
    }
    Ok(())
}

pub async fn keys(cmd: KeysCommand) -> Result<()> {
    match cmd {
        KeysCommand::Create { org, name, billing_mode, fallback_to_credits, store, json } => {
            let new = NewKey { org_id: &org, name: &name, billing_mode, fallback_to_credits };
            let (key, secret) = open(&store).await?.create_key(new).await?;
            let mut value = json!(key);
            value["secret"] = json!(secret);
            print(
                json,
                value,
                format!("created key {} for {}; its secret, shown only now:\n{secret}", key.id, key.org_id),
            );
        }
        KeysCommand::Revoke { key_id, store, json } => {
            let revoked = open(&store).await?.revoke_key(&key_id).await?;
            let human = if revoked { format!("revoked {key_id}") } else { format!("{key_id} was already revoked") };
            print(json, json!({"id": key_id, "revoked": true, "was_active": revoked}), human);
        }
        KeysCommand::List { org, store, json } => {
            let keys = open(&store).await?.list_keys(&org).await?;
            let human = keys
                .iter()
                .map(|k| {
                    let state = if k.revoked_at.is_some() { "revoked" } else { "active" };
                    format!("{}  {}  {:?}  {state}", k.id, k.name, k.billing_mode)
                })
                .collect::<Vec<_>>()
                .join("\n");
            print(json, json!(keys), human);
        }
    }
    Ok(())
}
