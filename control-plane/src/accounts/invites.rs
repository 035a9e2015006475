//! Invites: an e-mail address and a role, bound to an organization, with a 256-bit code
//! that only the e-mail carries (its hash is what is stored). Accepting is one
//! conditional update that must change exactly one row: a code is used once, by the
//! invited address, before it expires, unless cancelled.

use super::people::{Role, parse_role};
use super::store::{Store, StoreError, insert_membership, normalize_email, now};
use super::{Org, keys};
use serde::Serialize;
use sqlx::Row;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Invite {
    pub id: String,
    pub org_id: String,
    pub email: String,
    pub role: Role,
    pub invited_by: String,
    pub created_at: i64,
    pub sent_at: i64,
    pub expires_at: i64,
    pub accepted_at: Option<i64>,
    pub cancelled_at: Option<i64>,
}

/// Where an invite stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum InviteState {
    Pending,
    Accepted,
    Cancelled,
    Expired,
}

impl Invite {
    pub fn state(&self, now: i64) -> InviteState {
        if self.accepted_at.is_some() {
            InviteState::Accepted
        } else if self.cancelled_at.is_some() {
            InviteState::Cancelled
        } else if self.expires_at <= now {
            InviteState::Expired
        } else {
            InviteState::Pending
        }
    }
}

/// What happened to an attempt to accept.
#[derive(Debug, PartialEq)]
pub enum Acceptance {
    /// Applied: the user is now in the organization (with the invite's role, or the
    /// one they already had).
    Joined(Org),
    /// No invite has this code.
    Unknown,
    /// The invite is for another address.
    OtherEmail,
    /// Used, cancelled or expired.
    NotPending(InviteState),
}

/// The columns `invite_from_row` reads; a macro so queries stay static strings.
macro_rules! columns {
    () => {
        "id, org_id, email, role, invited_by, created_at, sent_at, expires_at, accepted_at, cancelled_at"
    };
}

impl Store {
    /// Creates an invite valid for `ttl` seconds; returns it with its code, which is
    /// not kept. Refused for personal organizations, for members, and for an address
    /// with an invite still pending.
    pub async fn create_invite(
        &self,
        org_id: &str,
        email: &str,
        role: Role,
        invited_by: &str,
        ttl: i64,
    ) -> Result<(Invite, String), StoreError> {
        let email = normalize_email(email);
        if !super::store::well_formed_email(&email) {
            return Err(StoreError::Invalid(format!("{email:?} is not an e-mail address")));
        }
        if self.is_personal(org_id).await? {
            return Err(StoreError::Invalid(
                "a personal organization has one member: create an organization to invite people".into(),
            ));
        }
        let member = sqlx::query(
            "SELECT u.id FROM memberships m JOIN users u ON u.id = m.user_id WHERE m.org_id = $1 AND u.email = $2",
        )
        .bind(org_id)
        .bind(&email)
        .fetch_optional(&self.pool)
        .await?;
        if member.is_some() {
            return Err(StoreError::Invalid(format!("{email} is already a member")));
        }
        let now = now();
        if self.invites(org_id).await?.iter().any(|i| i.email == email && i.state(now) == InviteState::Pending) {
            return Err(StoreError::Invalid(format!("{email} has an invite waiting: resend it or cancel it")));
        }
        let code = keys::token();
        let invite = Invite {
            id: keys::random_id("inv_"),
            org_id: org_id.to_string(),
            email,
            role,
            invited_by: invited_by.to_string(),
            created_at: now,
            sent_at: now,
            expires_at: now + ttl,
            accepted_at: None,
            cancelled_at: None,
        };
        sqlx::query(
            "INSERT INTO invites (id, org_id, email, role, code_hash, invited_by, created_at, sent_at, expires_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&invite.id)
        .bind(&invite.org_id)
        .bind(&invite.email)
        .bind(invite.role.as_str())
        .bind(keys::hash(&code))
        .bind(&invite.invited_by)
        .bind(invite.created_at)
        .bind(invite.sent_at)
        .bind(invite.expires_at)
        .execute(&self.pool)
        .await?;
        Ok((invite, code))
    }

    /// An organization's invites, newest first.
    pub async fn invites(&self, org_id: &str) -> Result<Vec<Invite>, StoreError> {
        let rows =
            sqlx::query(concat!("SELECT ", columns!(), " FROM invites WHERE org_id = $1 ORDER BY created_at DESC, id"))
                .bind(org_id)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(invite_from_row).collect()
    }

    /// The invite with this id in this organization.
    pub async fn invite(&self, org_id: &str, id: &str) -> Result<Option<Invite>, StoreError> {
        let row = sqlx::query(concat!("SELECT ", columns!(), " FROM invites WHERE org_id = $1 AND id = $2"))
            .bind(org_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(invite_from_row).transpose()
    }

    /// The invite a code opens (whatever its state), with its organization.
    pub async fn invite_by_code(&self, code: &str) -> Result<Option<(Invite, Org)>, StoreError> {
        let row = sqlx::query(concat!("SELECT ", columns!(), " FROM invites WHERE code_hash = $1"))
            .bind(keys::hash(code))
            .fetch_optional(&self.pool)
            .await?;
        let Some(invite) = row.as_ref().map(invite_from_row).transpose()? else { return Ok(None) };
        let org = self.find_org(&invite.org_id).await?;
        Ok(Some((invite, org)))
    }

    /// A new code for a pending (or expired, not used or cancelled) invite, valid for
    /// `ttl` seconds from now; the old code stops working. None if it cannot be resent.
    pub async fn resend_invite(
        &self,
        org_id: &str,
        id: &str,
        ttl: i64,
    ) -> Result<Option<(Invite, String)>, StoreError> {
        let code = keys::token();
        let now = now();
        let done = sqlx::query(
            "UPDATE invites SET code_hash = $1, sent_at = $2, expires_at = $3 \
             WHERE org_id = $4 AND id = $5 AND accepted_at IS NULL AND cancelled_at IS NULL",
        )
        .bind(keys::hash(&code))
        .bind(now)
        .bind(now + ttl)
        .bind(org_id)
        .bind(id)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() != 1 {
            return Ok(None);
        }
        Ok(self.invite(org_id, id).await?.map(|i| (i, code)))
    }

    /// Cancels a pending invite; false if it was not pending.
    pub async fn cancel_invite(&self, org_id: &str, id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE invites SET cancelled_at = $1 WHERE org_id = $2 AND id = $3 \
             AND accepted_at IS NULL AND cancelled_at IS NULL",
        )
        .bind(now())
        .bind(org_id)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Accepts the invite this code opens for `user_id` (whose address must be the
    /// invited one): one conditional update, then the membership, in one transaction.
    pub async fn accept_invite(&self, code: &str, user_id: &str) -> Result<Acceptance, StoreError> {
        let Some((invite, org)) = self.invite_by_code(code).await? else { return Ok(Acceptance::Unknown) };
        let user = self.find_user(user_id).await?;
        if user.email != invite.email {
            return Ok(Acceptance::OtherEmail);
        }
        let now = now();
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query(
            "UPDATE invites SET accepted_at = $1, accepted_by = $2 WHERE code_hash = $3 AND email = $4 \
             AND accepted_at IS NULL AND cancelled_at IS NULL AND expires_at > $5",
        )
        .bind(now)
        .bind(user_id)
        .bind(keys::hash(code))
        .bind(&user.email)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() != 1 {
            drop(tx);
            return Ok(Acceptance::NotPending(invite.state(now)));
        }
        // One already in the organization (or joining through a second invite at the
        // same moment) keeps the role they have.
        insert_membership(&mut tx, &org.id, user_id, invite.role, now).await?;
        tx.commit().await?;
        Ok(Acceptance::Joined(org))
    }
}

fn invite_from_row(r: &sqlx::any::AnyRow) -> Result<Invite, StoreError> {
    Ok(Invite {
        id: r.try_get("id")?,
        org_id: r.try_get("org_id")?,
        email: r.try_get("email")?,
        role: parse_role(&r.try_get::<String, _>("role")?)?,
        invited_by: r.try_get("invited_by")?,
        created_at: r.try_get("created_at")?,
        sent_at: r.try_get("sent_at")?,
        expires_at: r.try_get("expires_at")?,
        accepted_at: r.try_get("accepted_at")?,
        cancelled_at: r.try_get("cancelled_at")?,
    })
}
