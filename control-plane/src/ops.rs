//! Operator commands: organizations, keys, credit and usage straight in the store, JSON
//! with `--json`.

use crate::accounts::NewKey;
use crate::billing::cost::{usd, usd_to_micros};
use crate::billing::payments::DevProcessor;
use crate::billing::subscriptions::Subscriptions;
use crate::config::{
    CapacityCommand, CreditsCommand, KeysCommand, OrgsCommand, PlansCommand, StoreArgs, SupplyCommand, UsageCommand,
    UsersCommand,
};
use crate::db::Db;
use crate::limits::now_us;
use anyhow::Result;
use serde_json::json;
use std::sync::Arc;

async fn open(store: &StoreArgs) -> Result<Db> {
    std::fs::create_dir_all(&store.data_dir)?;
    Ok(Db::open(&store.database_url()).await?)
}

/// Prints `value` as JSON with `--json`, else the line for people.
pub(crate) fn print(json_out: bool, value: serde_json::Value, human: String) {
    if json_out {
        println!("{value}");
    } else {
        println!("{human}");
    }
}

pub async fn orgs(cmd: OrgsCommand) -> Result<()> {
    match cmd {
        OrgsCommand::Create { name, store, json } => {
            let org = open(&store).await?.accounts().create_org(&name).await?;
            print(json, json!(org), format!("created organization {} ({})", org.id, org.name));
        }
        OrgsCommand::SetRateLimit { org, rpm, default: _, store, json } => {
            anyhow::ensure!(rpm != Some(0), "--rpm must be at least 1");
            let db = open(&store).await?;
            let store = db.accounts();
            let org = store.find_org(&org).await?;
            db.rate_limiter(Default::default()).set_org_rpm(&org.id, rpm).await?;
            let human = match rpm {
                Some(r) => format!("{}: {r} requests per minute", org.id),
                None => format!("{}: the server's default rate limit", org.id),
            };
            print(json, json!({"org_id": org.id, "rate_limit_rpm": rpm}), human);
        }
        OrgsCommand::SetWeight { org, weight, default: _, store, json } => {
            let db = open(&store).await?;
            let org = db.accounts().find_org(&org).await?;
            db.weights().set(&org.id, weight).await?;
            let weight = weight.unwrap_or(crate::weights::DEFAULT_WEIGHT);
            print(json, json!({"org_id": org.id, "weight": weight}), format!("{}: scheduling weight {weight}", org.id));
        }
    }
    Ok(())
}

pub async fn keys(cmd: KeysCommand) -> Result<()> {
    match cmd {
        KeysCommand::Create { org, name, billing_mode, fallback_to_credits, store, json } => {
            let new = NewKey { org_id: &org, name: &name, billing_mode, fallback_to_credits, created_by: None };
            let (key, secret) = open(&store).await?.accounts().create_key(new).await?;
            let mut value = json!(key);
            value["secret"] = json!(secret);
            print(
                json,
                value,
                format!("created key {} for {}; its secret, shown only now:\n{secret}", key.id, key.org_id),
            );
        }
        KeysCommand::Revoke { key_id, store, json } => {
            let revoked = open(&store).await?.accounts().revoke_key(&key_id).await?;
            let human = if revoked { format!("revoked {key_id}") } else { format!("{key_id} was already revoked") };
            print(json, json!({"id": key_id, "revoked": true, "was_active": revoked}), human);
        }
        KeysCommand::List { org, store, json } => {
            let keys = open(&store).await?.accounts().list_keys(&org).await?;
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
            let db = open(&store).await?;
            let store = db.accounts();
            let org = store.find_org(&org).await?;
            let micros = usd_to_micros(dollars)?;
            let ledger = db.ledger();
            ledger.grant(&org.id, micros, &memo).await?;
            let balance = ledger.balance(&org.id).await?;
            let human = format!("granted {} to {}; balance {}", usd(micros as i64), org.id, usd(balance));
            print(json, json!({"org_id": org.id, "granted_micros": micros, "balance_micros": balance}), human);
        }
        CreditsCommand::Buy { org, usd: dollars, payment_method, store, json } => {
            let db = open(&store).await?;
            let store = db.accounts();
            let org = store.find_org(&org).await?;
            let micros = usd_to_micros(dollars)?;
            let ledger = db.ledger();
            let reference = ledger.purchase(&DevProcessor::default(), &org.id, micros, &payment_method).await?;
            let balance = ledger.balance(&org.id).await?;
            let human = format!("{} bought {} ({reference}); balance {}", org.id, usd(micros as i64), usd(balance));
            let value =
                json!({"org_id": org.id, "bought_micros": micros, "balance_micros": balance, "payment": reference});
            print(json, value, human);
        }
        CreditsCommand::Show { org, store, json } => {
            let db = open(&store).await?;
            let store = db.accounts();
            let org = store.find_org(&org).await?;
            let ledger = db.ledger();
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
            let db = open(&store).await?;
            let store = db.accounts();
            let org = store.find_org(&org).await?;
            let records = db.ledger().usage(&org.id, limit).await?;
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

pub async fn capacity(cmd: CapacityCommand) -> Result<()> {
    let line = |r: &crate::capacity::CapacityRequest| {
        format!("{}  {:<9}  {}  {}  {}", r.id, r.status.as_str(), r.org_id, r.wanted.summary(), r.wanted.contact_email)
    };
    match cmd {
        CapacityCommand::List { org, store, json } => {
            let db = open(&store).await?;
            let store = db.accounts();
            let org = match org {
                Some(o) => Some(store.find_org(&o).await?.id),
                None => None,
            };
            let requests = db.capacity_requests().list(org.as_deref()).await?;
            let human = if requests.is_empty() {
                "no capacity requests".to_string()
            } else {
                requests.iter().map(line).collect::<Vec<_>>().join("\n")
            };
            print(json, json!(requests), human);
        }
        CapacityCommand::Show { id, store, json } => {
            let db = open(&store).await?;
            let r =
                db.capacity_requests().get(&id).await?.ok_or_else(|| anyhow::anyhow!("no capacity request {id:?}"))?;
            let w = &r.wanted;
            let human = format!(
                "{}\nstatus: {}\norganization: {}\nrequested by: {}\nwhat: {}\ncontact: {} <{}>\nnotes: {}\nsent: {}\nupdated: {}",
                r.id,
                r.status.as_str(),
                r.org_id,
                r.requested_by,
                w.summary(),
                w.contact_name,
                w.contact_email,
                w.notes,
                crate::calendar::rfc3339(r.created_at),
                crate::calendar::rfc3339(r.updated_at)
            );
            print(json, json!(r), human);
        }
        CapacityCommand::SetStatus { id, status, store, json } => {
            let db = open(&store).await?;
            anyhow::ensure!(db.capacity_requests().set_status(&id, status).await?, "no capacity request {id:?}");
            print(json, json!({"id": id, "status": status}), format!("{id} is now {}", status.as_str()));
        }
    }
    Ok(())
}

pub async fn users(cmd: UsersCommand) -> Result<()> {
    match cmd {
        UsersCommand::Create { email, store, json } => {
            let user = open(&store).await?.accounts().create_user(&email).await?;
            let human = format!("created user {} ({}); personal organization {}", user.id, user.email, user.org_id);
            print(json, json!(user), human);
        }
        UsersCommand::SetPassword { email, password_stdin, console_url, store, json } => {
            let db = open(&store).await?;
            let store = db.accounts();
            let user = store.find_user(&email).await?;
            if password_stdin {
                let mut password = String::new();
                std::io::stdin().read_line(&mut password)?;
                let password = password.trim_end_matches(['\r', '\n']);
                if let Some(problem) = crate::console::password::problem(password, &user.email) {
                    anyhow::bail!("{problem}");
                }
                store.set_password(&user.id, &crate::console::password::hash(password)).await?;
                print(json, json!({"user": user.id, "password_set": true}), format!("password set for {}", user.email));
            } else {
                let purpose = crate::accounts::LinkPurpose::Password { user_id: user.id.clone() };
                let token = store.create_link(&purpose, 86_400).await?;
                let link = format!("{}/setup?token={token}", console_url.trim_end_matches('/'));
                let human = format!("{} can set a password once, within 24 hours, at:\n{link}", user.email);
                print(json, json!({"user": user.id, "link": link}), human);
            }
        }
    }
    Ok(())
}

/// Plans through the development processor: no real payment processor runs here.
fn plans_of(db: &Db) -> Subscriptions {
    db.subscriptions(Arc::new(DevProcessor::default()))
}

pub async fn plans(cmd: PlansCommand) -> Result<()> {
    match cmd {
        PlansCommand::Start { user, plan, payment_method, store, json } => {
            let db = open(&store).await?;
            let store = db.accounts();
            let user = store.find_user(&user).await?;
            let s = plans_of(&db).start(&user.id, plan, &payment_method, now_us()).await?;
            let human = format!(
                "{} is on the {} plan: {} paid, {} of usage included this period",
                user.email,
                plan.as_str(),
                usd(s.paid_micros),
                usd(s.included_micros)
            );
            print(json, json!(s), human);
        }
        PlansCommand::Change { user, plan, store, json } => {
            let db = open(&store).await?;
            let store = db.accounts();
            let user = store.find_user(&user).await?;
            let plans = plans_of(&db);
            let change = plans.change(&user.id, plan, now_us()).await?;
            let s = plans.get(&user.id).await?;
            print(json, json!({"change": change, "subscription": s}), format!("{}: {change:?}", user.email));
        }
        PlansCommand::Show { user, store, json } => {
            let db = open(&store).await?;
            let store = db.accounts();
            let user = store.find_user(&user).await?;
            let s = plans_of(&db).get(&user.id).await?;
            let human = match &s {
                None => format!("{} has no plan", user.email),
                Some(s) => format!(
                    "{}: {} plan ({:?}), {} of {} included usage left this period, {} in flight",
                    user.email,
                    s.plan.as_str(),
                    s.status,
                    usd(s.left_micros()),
                    usd(s.included_micros),
                    s.in_flight
                ),
            };
            print(json, json!(s), human);
        }
    }
    Ok(())
}

pub async fn supply(cmd: SupplyCommand) -> Result<()> {
    match cmd {
        SupplyCommand::Show { hours, store, json } => {
            let db = open(&store).await?;
            let supply = db.supply();
            supply.reload().await?;
            let since = now_us() - hours as i64 * 3_600_000_000;
            let mut models = Vec::new();
            let mut human = Vec::new();
            for p in supply.current() {
                let history = supply.history(&p.model, since).await?;
                human.push(format!(
                    "{}  {}  {}% off  (mean load {}%, {} states in {hours} h)",
                    p.model,
                    p.state.as_str(),
                    p.state.discount_percent(),
                    p.load_bp / 100,
                    history.len()
                ));
                models.push(json!({
                    "model": p.model,
                    "state": p.state,
                    "discount_percent": p.state.discount_percent(),
                    "multiplier_bp": p.state.multiplier_bp(),
                    "updated_at_us": p.updated_at,
                    "history": history,
                }));
            }
            print(json, json!({"models": models}), human.join("\n"));
        }
    }
    Ok(())
}
