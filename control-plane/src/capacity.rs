//! Requests for dedicated GPU capacity: reserved VMs, bare-metal
//! nodes and multi-node clusters are sourced by hand, so a request is a record an
//! operator works through — received, in review, quoted, closed — never an order.
//! What a request must say, and the limits on it, are checked here once, for the
//! console's form and for anything else that makes one.

use crate::calendar::parse_date;
use serde::Serialize;
use sqlx::{AnyPool, Row};

pub const GPU_TYPES: [&str; 5] = ["H100 80GB SXM", "H200 141GB SXM", "B200 180GB", "A100 80GB SXM", "L40S 48GB"];
pub const REGIONS: [&str; 6] = ["us-east", "us-west", "eu-west", "eu-central", "asia-east", "any"];
/// Terms offered, in months.
pub const TERMS: [i64; 6] = [1, 3, 6, 12, 24, 36];
/// What each GPU type has tended to cost per GPU-hour on reserved terms: shown as a
/// guide only, never as a quote (price depends on configuration, region, start date
/// and term).
pub const INDICATIVE: [(&str, &str); 5] = [
    ("H100 80GB SXM", "$1.90–$2.80"),
    ("H200 141GB SXM", "$2.40–$3.50"),
    ("B200 180GB", "$3.80–$5.50"),
    ("A100 80GB SXM", "$1.10–$1.70"),
    ("L40S 48GB", "$0.70–$1.10"),
];
/// GPUs in one bare-metal node or cluster node.
pub const GPUS_PER_NODE: i64 = 8;
/// Requests one organization may send in a day: enough for any real need, too few to
/// turn the operators' inbox into anyone's mailing list.
pub const PER_ORG_PER_DAY: i64 = 5;
/// How far ahead a start date may be, in days.
pub const MAX_LEAD_DAYS: i64 = 366;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Topology {
    /// A reserved virtual machine with 1 to 8 GPUs.
    Vm,
    /// Whole bare-metal nodes of 8 GPUs, 1 to 8 of them.
    BareMetal,
    /// A private multi-node cluster: 2 to 128 nodes of 8 GPUs.
    Cluster,
}

impl Topology {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Vm => "vm",
            Self::BareMetal => "bare_metal",
            Self::Cluster => "cluster",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::Vm => "Reserved VM",
            Self::BareMetal => "Bare-metal nodes",
            Self::Cluster => "Multi-node cluster",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [Self::Vm, Self::BareMetal, Self::Cluster].into_iter().find(|t| t.as_str() == s)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum RequestStatus {
    Received,
    InReview,
    Quoted,
    Closed,
}

impl RequestStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Received => "received",
            Self::InReview => "in_review",
            Self::Quoted => "quoted",
            Self::Closed => "closed",
        }
    }

    fn parse(s: &str) -> Result<Self, sqlx::Error> {
        [Self::Received, Self::InReview, Self::Quoted, Self::Closed]
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| sqlx::Error::Decode(format!("unknown capacity request status {s:?}").into()))
    }
}

/// The form as typed.
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(default)]
pub struct Form {
    pub gpu_type: String,
    pub topology: String,
    pub gpus: String,
    pub nodes: String,
    pub region: String,
    pub start_date: String,
    pub term_months: String,
    pub contact_name: String,
    pub contact_email: String,
    pub notes: String,
}

/// A checked request, ready to store.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Wanted {
    pub gpu_type: String,
    pub topology: Topology,
    pub gpus: i64,
    pub nodes: i64,
    pub region: String,
    pub start_date: String,
    pub term_months: i64,
    pub contact_name: String,
    pub contact_email: String,
    pub notes: String,
}

/// A stored request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CapacityRequest {
    pub id: String,
    pub org_id: String,
    pub requested_by: String,
    #[serde(flatten)]
    pub wanted: Wanted,
    pub status: RequestStatus,
    /// µs since the epoch.
    pub created_at: i64,
    pub updated_at: i64,
}

/// A field and what is wrong with it, as the form shows it.
pub type Problems = Vec<(&'static str, String)>;

fn whole(text: &str) -> Option<i64> {
    let t = text.trim();
    (!t.is_empty() && t.len() <= 6 && t.bytes().all(|b| b.is_ascii_digit())).then(|| t.parse().ok()).flatten()
}

impl Form {
    /// Checks every field against `today` (days since the epoch, UTC), naming each
    /// problem beside its field.
    pub fn check(&self, today: i64) -> Result<Wanted, Problems> {
        let mut problems = Problems::new();
        let gpu_type = GPU_TYPES.iter().find(|g| **g == self.gpu_type.trim());
        if gpu_type.is_none() {
            problems.push(("gpu_type", "Choose a GPU type from the list.".into()));
        }
        let topology = Topology::parse(self.topology.trim());
        let (mut gpus, mut nodes) = (0, 0);
        match topology {
            None => problems.push(("topology", "Choose a reserved VM, bare-metal nodes or a cluster.".into())),
            Some(Topology::Vm) => match whole(&self.gpus) {
                Some(n @ 1..=8) => (gpus, nodes) = (n, 1),
                _ => problems.push(("gpus", "A reserved VM has 1 to 8 GPUs.".into())),
            },
            Some(t) => {
                let range = if t == Topology::BareMetal { 1..=8 } else { 2..=128 };
                match whole(&self.nodes) {
                    Some(n) if range.contains(&n) => (gpus, nodes) = (n * GPUS_PER_NODE, n),
                    _ => problems.push((
                        "nodes",
                        format!(
                            "{} take {} to {} nodes of {GPUS_PER_NODE} GPUs.",
                            t.label(),
                            range.start(),
                            range.end()
                        ),
                    )),
                }
            }
        }
        let region = REGIONS.iter().find(|r| **r == self.region.trim());
        if region.is_none() {
            problems.push(("region", "Choose a region from the list.".into()));
        }
        match parse_date(&self.start_date) {
            None => problems.push(("start_date", "Give the start date as a real date (YYYY-MM-DD).".into())),
            Some(d) if d < today => problems.push(("start_date", "The start date is in the past.".into())),
            Some(d) if d > today + MAX_LEAD_DAYS => {
                problems.push(("start_date", format!("Start within {MAX_LEAD_DAYS} days from today.")))
            }
            Some(_) => {}
        }
        let term = whole(&self.term_months).filter(|t| TERMS.contains(t));
        if term.is_none() {
            problems.push(("term_months", "Choose a term from the list.".into()));
        }
        let name = self.contact_name.trim();
        if name.is_empty() || name.chars().count() > 100 {
            problems.push(("contact_name", "Give a contact name of at most 100 characters.".into()));
        }
        let email = crate::accounts::store::normalize_email(&self.contact_email);
        if !crate::accounts::store::well_formed_email(&email) {
            problems.push(("contact_email", "Give an e-mail address we can reply to.".into()));
        }
        let notes = self.notes.trim();
        if notes.chars().count() > 2000 {
            problems.push(("notes", "Notes have at most 2,000 characters.".into()));
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        Ok(Wanted {
            gpu_type: gpu_type.map(|g| g.to_string()).unwrap_or_default(),
            topology: topology.unwrap_or(Topology::Vm),
            gpus,
            nodes,
            region: region.map(|r| r.to_string()).unwrap_or_default(),
            start_date: self.start_date.trim().to_string(),
            term_months: term.unwrap_or_default(),
            contact_name: name.to_string(),
            contact_email: email,
            notes: notes.to_string(),
        })
    }
}

impl Wanted {
    /// One line: "16 × H100 80GB SXM, multi-node cluster of 2 nodes, eu-west, from 2027-01-04 for 12 months".
    pub fn summary(&self) -> String {
        let shape = match self.topology {
            Topology::Vm => "reserved VM".to_string(),
            Topology::BareMetal => format!("bare metal, {} node{}", self.nodes, if self.nodes == 1 { "" } else { "s" }),
            Topology::Cluster => format!("multi-node cluster of {} nodes", self.nodes),
        };
        format!(
            "{} × {}, {shape}, {}, from {} for {} month{}",
            self.gpus,
            self.gpu_type,
            self.region,
            self.start_date,
            self.term_months,
            if self.term_months == 1 { "" } else { "s" }
        )
    }
}

/// Capacity requests in the account store's database.
#[derive(Clone)]
pub struct CapacityRequests {
    pool: AnyPool,
}

const COLUMNS: &str = "id, org_id, requested_by, gpu_type, topology, gpus, nodes, region, start_date, term_months, \
                       contact_name, contact_email, notes, status, created_at, updated_at";

fn from_row(r: &sqlx::any::AnyRow) -> Result<CapacityRequest, sqlx::Error> {
    let topology: String = r.try_get("topology")?;
    Ok(CapacityRequest {
        id: r.try_get("id")?,
        org_id: r.try_get("org_id")?,
        requested_by: r.try_get("requested_by")?,
        wanted: Wanted {
            gpu_type: r.try_get("gpu_type")?,
            topology: Topology::parse(&topology)
                .ok_or_else(|| sqlx::Error::Decode(format!("unknown topology {topology:?}").into()))?,
            gpus: r.try_get("gpus")?,
            nodes: r.try_get("nodes")?,
            region: r.try_get("region")?,
            start_date: r.try_get("start_date")?,
            term_months: r.try_get("term_months")?,
            contact_name: r.try_get("contact_name")?,
            contact_email: r.try_get("contact_email")?,
            notes: r.try_get("notes")?,
        },
        status: RequestStatus::parse(&r.try_get::<String, _>("status")?)?,
        created_at: r.try_get("created_at")?,
        updated_at: r.try_get("updated_at")?,
    })
}

impl CapacityRequests {
    pub fn new(pool: AnyPool) -> Self {
        Self { pool }
    }

    pub async fn create(&self, org_id: &str, user_id: &str, w: &Wanted) -> Result<CapacityRequest, sqlx::Error> {
        let id = crate::accounts::keys::random_id("cap_");
        let now = crate::limits::now_us();
        sqlx::query(
            "INSERT INTO capacity_requests (id, org_id, requested_by, gpu_type, topology, gpus, nodes, region, \
             start_date, term_months, contact_name, contact_email, notes, status, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, 'received', $14, $14)",
        )
        .bind(&id)
        .bind(org_id)
        .bind(user_id)
        .bind(&w.gpu_type)
        .bind(w.topology.as_str())
        .bind(w.gpus)
        .bind(w.nodes)
        .bind(&w.region)
        .bind(&w.start_date)
        .bind(w.term_months)
        .bind(&w.contact_name)
        .bind(&w.contact_email)
        .bind(&w.notes)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(CapacityRequest {
            id,
            org_id: org_id.into(),
            requested_by: user_id.into(),
            wanted: w.clone(),
            status: RequestStatus::Received,
            created_at: now,
            updated_at: now,
        })
    }

    /// Every request (`org`: one organization's), newest first.
    pub async fn list(&self, org: Option<&str>) -> Result<Vec<CapacityRequest>, sqlx::Error> {
        let rows = match org {
            Some(org) => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT {COLUMNS} FROM capacity_requests WHERE org_id = $1 ORDER BY created_at DESC, id"
                )))
                .bind(org)
                .fetch_all(&self.pool)
                .await?
            }
            None => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT {COLUMNS} FROM capacity_requests ORDER BY created_at DESC, id"
                )))
                .fetch_all(&self.pool)
                .await?
            }
        };
        rows.iter().map(from_row).collect()
    }

    pub async fn get(&self, id: &str) -> Result<Option<CapacityRequest>, sqlx::Error> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {COLUMNS} FROM capacity_requests WHERE id = $1")))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// How many requests `org` has sent since `since` (µs).
    pub async fn count_since(&self, org: &str, since: i64) -> Result<i64, sqlx::Error> {
        let row = sqlx::query("SELECT COUNT(*) AS n FROM capacity_requests WHERE org_id = $1 AND created_at >= $2")
            .bind(org)
            .bind(since)
            .fetch_one(&self.pool)
            .await?;
        row.try_get("n")
    }

    /// Moves a request to `status`; false if there is no such request.
    pub async fn set_status(&self, id: &str, status: RequestStatus) -> Result<bool, sqlx::Error> {
        let done = sqlx::query("UPDATE capacity_requests SET status = $1, updated_at = $2 WHERE id = $3")
            .bind(status.as_str())
            .bind(crate::limits::now_us())
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calendar::days_from_civil;

    fn form() -> Form {
        Form {
            gpu_type: "H100 80GB SXM".into(),
            topology: "cluster".into(),
            gpus: String::new(),
            nodes: "4".into(),
            region: "eu-west".into(),
            start_date: "2027-01-04".into(),
            term_months: "12".into(),
            contact_name: "Ada Lovelace".into(),
            contact_email: "Ada@Example.com".into(),
            notes: "Llama 70B fine-tuning".into(),
        }
    }

    #[test]
    fn a_good_request_is_sized_by_its_topology() {
        let today = days_from_civil(2026, 11, 24);
        let w = form().check(today).unwrap();
        assert_eq!((w.gpus, w.nodes, w.contact_email.as_str()), (32, 4, "ada@example.com"));
        assert_eq!(
            w.summary(),
            "32 × H100 80GB SXM, multi-node cluster of 4 nodes, eu-west, from 2027-01-04 for 12 months"
        );
        let vm = Form { topology: "vm".into(), gpus: "2".into(), ..form() }.check(today).unwrap();
        assert_eq!((vm.gpus, vm.nodes), (2, 1));
        let today_is_fine = Form { start_date: "2026-11-24".into(), ..form() };
        assert!(today_is_fine.check(today).is_ok());
    }

    #[test]
    fn each_problem_is_named_beside_its_field() {
        let today = days_from_civil(2026, 11, 24);
        let bad = Form {
            gpu_type: "TPU".into(),
            topology: "vm".into(),
            gpus: "9".into(),
            region: "mars".into(),
            start_date: "2026-11-23".into(),
            term_months: "7".into(),
            contact_name: " ".into(),
            contact_email: "nobody".into(),
            notes: "x".repeat(2001),
            ..form()
        };
        let fields: Vec<&str> = bad.check(today).unwrap_err().iter().map(|(f, _)| *f).collect();
        assert_eq!(
            fields,
            ["gpu_type", "gpus", "region", "start_date", "term_months", "contact_name", "contact_email", "notes"]
        );
        for (field, f) in [
            ("nodes", Form { nodes: "1".into(), ..form() }),
            ("nodes", Form { topology: "bare_metal".into(), nodes: "9".into(), ..form() }),
            ("start_date", Form { start_date: "2026-02-30".into(), ..form() }),
            ("start_date", Form { start_date: "2028-01-01".into(), ..form() }),
            ("topology", Form { topology: "mainframe".into(), ..form() }),
        ] {
            assert_eq!(f.check(today).unwrap_err()[0].0, field);
        }
    }
}
