//! Dedicated capacity: the request form (GPU type, topology and size, region, start
//! date, term, contact, notes), checked field by field; each request stored as
//! received, confirmed to the requester by e-mail and sent to the operators
//! (`--capacity-requests-to`) through the same mail path as invites. Provisioning is
//! manual: the page says so, and that indicative prices are not quotes. Operators move
//! requests along with `tessera capacity`.

use super::authz::{Action, Offers, authorize};
use super::page::{Frame, Notice, Result, done, render, when};
use super::session::Viewer;
use super::{Console, State};
use crate::accounts::Membership;
use crate::capacity::{
    CapacityRequest, Form as CapacityForm, GPU_TYPES, INDICATIVE, PER_ORG_PER_DAY, Problems, REGIONS, TERMS, Wanted,
};
use askama::Template;
use axum::Form;
use axum::extract::{Path, Query, State as Ctx};
use axum::http::StatusCode;
use axum::response::Response;

struct Row {
    id: String,
    summary: String,
    status: &'static str,
    created: String,
}

#[derive(Template)]
#[template(path = "capacity.html")]
struct CapacityPage {
    frame: Frame,
    membership: Membership,
    offers: Offers,
    form: CapacityForm,
    problems: Problems,
    requests: Vec<Row>,
    gpu_types: &'static [&'static str],
    regions: &'static [&'static str],
    terms: &'static [i64],
    indicative: &'static [(&'static str, &'static str)],
    today: String,
    done: Option<&'static str>,
    error: Option<String>,
}

impl CapacityPage {
    /// The problem with `field`, shown beside it.
    fn problem(&self, field: &str) -> Option<&str> {
        self.problems.iter().find(|(f, _)| *f == field).map(|(_, why)| why.as_str())
    }
}

fn today() -> i64 {
    crate::limits::now_us().div_euclid(crate::billing::usage::DAY_US)
}

async fn show(
    console: &Console,
    viewer: &Viewer,
    membership: Membership,
    form: CapacityForm,
    problems: Problems,
    refused: Option<String>,
    done: Option<&'static str>,
) -> Result<Response> {
    let org = membership.org.id.clone();
    let requests = console
        .capacity
        .list(Some(&org))
        .await?
        .into_iter()
        .map(|r| Row {
            summary: r.wanted.summary(),
            status: r.status.as_str(),
            created: when(r.created_at / 1_000_000),
            id: r.id,
        })
        .collect();
    let status = if problems.is_empty() && refused.is_none() { StatusCode::OK } else { StatusCode::BAD_REQUEST };
    let error = refused.or_else(|| (!problems.is_empty()).then(|| "Some answers need another look: see below.".into()));
    let page = CapacityPage {
        frame: viewer.frame(console, "Dedicated capacity", Some(&org)).await?,
        offers: Offers::for_role(membership.role),
        membership,
        form,
        problems,
        requests,
        gpu_types: &GPU_TYPES,
        regions: &REGIONS,
        terms: &TERMS,
        indicative: &INDICATIVE,
        today: crate::calendar::date(today() * crate::billing::usage::DAY_US),
        done,
        error,
    };
    Ok(render(status, &page))
}

pub async fn page(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Query(notice): Query<Notice>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::View).await?;
    let form = CapacityForm {
        contact_email: viewer.session.user.email.clone(),
        topology: "vm".into(),
        gpus: "8".into(),
        nodes: "2".into(),
        term_months: "12".into(),
        ..CapacityForm::default()
    };
    show(&console, &viewer, membership, form, Problems::new(), None, notice.text()).await
}

pub async fn submit(
    Ctx(console): Ctx<State>,
    viewer: Viewer,
    Path(org): Path<String>,
    Form(form): Form<CapacityForm>,
) -> Result<Response> {
    let membership = authorize(&console, &viewer, &org, Action::ManageBilling).await?;
    let wanted = match form.check(today()) {
        Ok(w) => w,
        Err(problems) => return show(&console, &viewer, membership, form, problems, None, None).await,
    };
    let requests = &console.capacity;
    let day_ago = crate::limits::now_us() - crate::billing::usage::DAY_US;
    if requests.count_since(&org, day_ago).await? >= PER_ORG_PER_DAY {
        let why = format!(
            "This organization has sent {PER_ORG_PER_DAY} requests in the last 24 hours: we answer those first. \
             Add anything else to your reply to our e-mail."
        );
        return show(&console, &viewer, membership, form, Problems::new(), Some(why), None).await;
    }
    let request = requests.create(&org, viewer.user_id(), &wanted).await?;
    let mailed = mail(&console, &membership, &viewer.session.user.email, &request).await;
    Ok(done(&format!("/o/{org}/capacity"), if mailed { "capacity" } else { "capacity-unmailed" }))
}

/// The requester's copy and the operators' notice; false if either was not sent (the
/// request is stored all the same, and operators list it with `tessera capacity list`).
async fn mail(console: &Console, membership: &Membership, requester: &str, r: &CapacityRequest) -> bool {
    let w: &Wanted = &r.wanted;
    let details = format!(
        "Request {id}\nOrganization: {org} ({org_id})\nGPUs: {summary}\nContact: {name} <{email}>\nNotes: {notes}\n",
        id = r.id,
        org = membership.org.name,
        org_id = membership.org.id,
        summary = w.summary(),
        name = w.contact_name,
        email = w.contact_email,
        notes = if w.notes.is_empty() { "(none)" } else { &w.notes },
    );
    let copy = format!(
        "We received your request for dedicated GPU capacity.\n\n{details}\n\
         Dedicated capacity is sourced by hand: it is not instant, and nothing is reserved or charged yet. \
         Price and availability depend on the configuration, region, start date and term; any indicative price \
         you saw is not a quote. We will reply to {email} with availability and a quote.\n",
        email = w.contact_email,
    );
    // To the signed-in requester only: the form's contact address is not verified, and
    // mail to it would let anyone send our mail to anyone.
    let mut sent = true;
    let subject = format!("Your dedicated capacity request {}", r.id);
    if let Err(e) = console.mail.send(requester, &subject, copy).await {
        tracing::warn!(error = %e, request = %r.id, "the capacity request's copy was not sent");
        sent = false;
    }
    match &console.config.capacity_requests_to {
        Some(operators) => {
            let subject = format!("Capacity request {}: {}", r.id, w.summary());
            let body = format!(
                "A new dedicated capacity request, status received.\n\n{details}\n\
                                Move it along with `tessera capacity set-status {} in_review`.\n",
                r.id
            );
            if let Err(e) = console.mail.send(operators, &subject, body).await {
                tracing::warn!(error = %e, request = %r.id, "the operators were not told of a capacity request");
                sent = false;
            }
        }
        None => tracing::warn!(request = %r.id, "a capacity request arrived and no --capacity-requests-to is set"),
    }
    sent
}
