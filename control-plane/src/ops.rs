//! Operator commands: organizations, keys, credit and usage straight in the store, JSON
//! with `--json`.

use crate::accounts::{NewKey, Store};
use crate::billing::cost::{usd, usd_to_micros};
use crate::config::{CreditsCommand, KeysCommand, OrgsCommand, StoreArgs, UsageCommand};
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
        OrgsCommand::SetRateLimit { org, rpm, default: _, store, json } => {
            anyhow::ensure!(rpm != Some(0), "--rpm must be at least 1");
            let store = open(&store).await?;
            let org = store.find_org(&org).await?;
            store.rate_limiter(Default::default()).set_org_rpm(&org.id, rpm).await?;
            let human = match rpm {
                Some(r) => format!("{}: {r} requests per minute", org.id),
                None => format!("{}: the server's default rate limit", org.id),
            };
            print(json, json!({"org_id": org.id, "rate_limit_rpm": rpm}), human);
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

pub async fn credits(cmd: CreditsCommand) -> Result<()> {
    match cmd {
        CreditsCommand::Grant { org, usd: dollars, memo, store, json } => {
            let store = open(&store).await?;
            let org = store.find_org(&org).await?;
            let micros = usd_to_micros(dollars)?;
            let ledger = store.ledger();
            ledger.grant(&org.id, micros, &memo).await?;
            let balance = ledger.balance(&org.id).await?;
            let human = format!("granted {} to {}; balance {}", usd(micros as i64), org.id, usd(balance));
            print(json, json!({"org_id": org.id, "granted_micros": micros, "balance_micros": balance}), human);
        }
        CreditsCommand::Show { org, store, json } => {
            let store = open(&store).await?;
            let org = store.find_org(&org).await?;
            let ledger = store.ledger();
            let (balance, held) = (ledger.balance(&org.id).await?, ledger.held(&org.id).await?);
            let human = format!("{}: balance {}, held by requests in flight {}", org.id, usd(balance), usd(held));
            print(json, json!({"org_id": org.id, "balance_micros": balance, "held_micros": held}), human);
        }
    }
    Ok(())
}

pub async fn usage(cmd: UsageCommand) -> Result<()> {
    match cmd {
        UsageCommand::List { org, limit, store, json } => {
            let store = open(&store).await?;
            let org = store.find_org(&org).await?;
            let records = store.ledger().usage(&org.id, limit).await?;
            let human = records
                .iter()
                .map(|u| {
                    format!(
                        "{}  {}  {}  prompt {} (cached {})  completion {}  {}  {}",
                        u.request_id,
                        u.model,
                        u.endpoint,
                        u.prompt_tokens,
                        u.cached_tokens,
                        u.completion_tokens,
                        usd(u.cost_micros as i64),
                        u.finish_reason
                    )
                })
                .collect::<Vec<_>>()
                .join("\n");
            print(json, json!(records), human);
        }
    }
    Ok(())
}
