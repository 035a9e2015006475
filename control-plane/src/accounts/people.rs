//! People in organizations: passwords, memberships and their roles. The rule that an
//! organization with an owner always keeps one is enforced here, under a lock on the
//! organization's row, so that two owners demoting each other at once cannot both win.

use super::store::{Store, StoreError, User, insert_membership, insert_org, now};
use super::{Org, keys};
use serde::Serialize;
use sqlx::Row;

/// What a member may do (`console::authz` decides what each role may change).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Member,
    Owner,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Owner => "owner",
            Self::Member => "member",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "owner" => Some(Self::Owner),
            "member" => Some(Self::Member),
            _ => None,
        }
    }
}

/// An organization as one of its members sees it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Membership {
    pub org: Org,
    pub role: Role,
    /// The organization is this user's personal one.
    pub personal: bool,
}

/// A member as the organization's member list shows them.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Member {
    pub user_id: String,
    pub email: String,
    pub role: Role,
    pub since: i64,
}

/// Why a change to the members was not made.
#[derive(Debug, PartialEq, Eq)]
pub enum MemberChange {
    Done,
    NotAMember,
    /// It would leave the organization without an owner.
    LastOwner,
}

impl Store {
    /// The user and their argon2id PHC string (None if they have not set a password).
    pub async fn user_with_password(&self, email: &str) -> Result<Option<(User, Option<String>)>, StoreError> {
        let row = sqlx::query("SELECT id, email, org_id, created_at, password_hash FROM users WHERE email = $1")
            .bind(super::store::normalize_email(email))
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| {
            Ok((
                User {
                    id: r.try_get("id")?,
                    email: r.try_get("email")?,
                    org_id: r.try_get("org_id")?,
                    created_at: r.try_get("created_at")?,
                },
                r.try_get("password_hash")?,
            ))
        })
        .transpose()
    }

    /// Sets a user's password and ends every session they have: whoever held one
    /// must sign in with the new password.
    pub async fn set_password(&self, user_id: &str, password_hash: &str) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await?;
        let done = sqlx::query("UPDATE users SET password_hash = $1 WHERE id = $2")
            .bind(password_hash)
            .bind(user_id)
            .execute(&mut *tx)
            .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NoUser(user_id.to_string()));
        }
        sqlx::query("DELETE FROM sessions WHERE user_id = $1").bind(user_id).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The organizations a user belongs to, their personal one first.
    pub async fn memberships(&self, user_id: &str) -> Result<Vec<Membership>, StoreError> {
        let rows = sqlx::query(
            "SELECT o.id, o.name, o.created_at, m.role, u.org_id AS personal FROM memberships m \
             JOIN orgs o ON o.id = m.org_id JOIN users u ON u.id = m.user_id \
             WHERE m.user_id = $1 ORDER BY o.created_at, o.id",
        )
        .bind(user_id)
        .fetch_all(&self.pool)
        .await?;
        let mut all = rows.iter().map(membership_from_row).collect::<Result<Vec<_>, _>>()?;
        all.sort_by_key(|m| !m.personal);
        Ok(all)
    }

    /// The user's membership of `org_id`, if they have one.
    pub async fn membership(&self, user_id: &str, org_id: &str) -> Result<Option<Membership>, StoreError> {
        let row = sqlx::query(
            "SELECT o.id, o.name, o.created_at, m.role, u.org_id AS personal FROM memberships m \
             JOIN orgs o ON o.id = m.org_id JOIN users u ON u.id = m.user_id \
             WHERE m.user_id = $1 AND m.org_id = $2",
        )
        .bind(user_id)
        .bind(org_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(membership_from_row).transpose()
    }

    /// Whether `org_id` is some user's personal organization.
    pub async fn is_personal(&self, org_id: &str) -> Result<bool, StoreError> {
        let row = sqlx::query("SELECT id FROM users WHERE org_id = $1").bind(org_id).fetch_optional(&self.pool).await?;
        Ok(row.is_some())
    }

    /// Creates an organization owned by `user_id`.
    pub async fn create_org_owned_by(&self, name: &str, user_id: &str) -> Result<Org, StoreError> {
        let name = name.trim();
        if name.is_empty() {
            return Err(StoreError::Invalid("an organization needs a name".into()));
        }
        if name.chars().count() > 100 {
            return Err(StoreError::Invalid("an organization's name has at most 100 characters".into()));
        }
        let org = Org { id: keys::random_id("org_"), name: name.to_string(), created_at: now() };
        let mut tx = self.pool.begin().await?;
        insert_org(&mut tx, &org).await?;
        insert_membership(&mut tx, &org.id, user_id, Role::Owner, org.created_at).await?;
        tx.commit().await?;
        Ok(org)
    }

    pub async fn rename_org(&self, org_id: &str, name: &str) -> Result<(), StoreError> {
        let name = name.trim();
        if name.is_empty() || name.chars().count() > 100 {
            return Err(StoreError::Invalid("an organization's name has 1 to 100 characters".into()));
        }
        sqlx::query("UPDATE orgs SET name = $1 WHERE id = $2").bind(name).bind(org_id).execute(&self.pool).await?;
        Ok(())
    }

    pub async fn members(&self, org_id: &str) -> Result<Vec<Member>, StoreError> {
        let rows = sqlx::query(
            "SELECT u.id, u.email, m.role, m.created_at FROM memberships m JOIN users u ON u.id = m.user_id \
             WHERE m.org_id = $1 ORDER BY m.created_at, u.email",
        )
        .bind(org_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Member {
                    user_id: r.try_get("id")?,
                    email: r.try_get("email")?,
                    role: parse_role(&r.try_get::<String, _>("role")?)?,
                    since: r.try_get("created_at")?,
                })
            })
            .collect()
    }

    pub async fn owner_count(&self, org_id: &str) -> Result<i64, StoreError> {
        Ok(sqlx::query("SELECT COUNT(*) AS n FROM memberships WHERE org_id = $1 AND role = 'owner'")
            .bind(org_id)
            .fetch_one(&self.pool)
            .await?
            .try_get("n")?)
    }

    /// A fact about this installation (`settings` table).
    pub async fn setting(&self, name: &str) -> Result<Option<String>, StoreError> {
        let row =
            sqlx::query("SELECT value FROM settings WHERE name = $1").bind(name).fetch_optional(&self.pool).await?;
        Ok(row.map(|r| r.try_get("value")).transpose()?)
    }

    pub async fn set_setting(&self, name: &str, value: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM settings WHERE name = $1").bind(name).execute(&self.pool).await?;
        sqlx::query("INSERT INTO settings (name, value) VALUES ($1, $2)")
            .bind(name)
            .bind(value)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Makes `user_id` an owner of `org_id` (the bootstrap organization's first owner).
    pub async fn add_owner(&self, org_id: &str, user_id: &str) -> Result<(), StoreError> {
        insert_membership(&mut *self.pool.acquire().await?, org_id, user_id, Role::Owner, now()).await
    }

    /// Changes a member's role; refused if it would leave no owner.
    pub async fn set_role(&self, org_id: &str, user_id: &str, role: Role) -> Result<MemberChange, StoreError> {
        self.change_member(org_id, user_id, Some(role)).await
    }

    /// Removes a member; refused if it would leave no owner. Their sessions stay, but
    /// the next request they make under this organization is refused.
    pub async fn remove_member(&self, org_id: &str, user_id: &str) -> Result<MemberChange, StoreError> {
        self.change_member(org_id, user_id, None).await
    }

    async fn change_member(&self, org_id: &str, user_id: &str, role: Option<Role>) -> Result<MemberChange, StoreError> {
        let mut tx = self.pool.begin().await?;
        // Locks the organization's row (PostgreSQL) or the database (SQLite) until the
        // end: the owner count read below cannot change under us.
        sqlx::query("UPDATE orgs SET name = name WHERE id = $1").bind(org_id).execute(&mut *tx).await?;
        let Some(current) = sqlx::query("SELECT role FROM memberships WHERE org_id = $1 AND user_id = $2")
            .bind(org_id)
            .bind(user_id)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(MemberChange::NotAMember);
        };
        let current = parse_role(&current.try_get::<String, _>("role")?)?;
        if current == Role::Owner && role != Some(Role::Owner) {
            let owners: i64 = sqlx::query("SELECT COUNT(*) AS n FROM memberships WHERE org_id = $1 AND role = 'owner'")
                .bind(org_id)
                .fetch_one(&mut *tx)
                .await?
                .try_get("n")?;
            if owners <= 1 {
                return Ok(MemberChange::LastOwner);
            }
        }
        match role {
            Some(role) => {
                sqlx::query("UPDATE memberships SET role = $1 WHERE org_id = $2 AND user_id = $3")
                    .bind(role.as_str())
                    .bind(org_id)
                    .bind(user_id)
                    .execute(&mut *tx)
                    .await?
            }
            None => {
                sqlx::query("DELETE FROM memberships WHERE org_id = $1 AND user_id = $2")
                    .bind(org_id)
                    .bind(user_id)
                    .execute(&mut *tx)
                    .await?
            }
        };
        tx.commit().await?;
        Ok(MemberChange::Done)
    }
}

pub(super) fn parse_role(s: &str) -> Result<Role, StoreError> {
    Role::parse(s).ok_or_else(|| StoreError::Invalid(format!("unknown role {s:?} in the database")))
}

fn membership_from_row(r: &sqlx::any::AnyRow) -> Result<Membership, StoreError> {
    let org = Org { id: r.try_get("id")?, name: r.try_get("name")?, created_at: r.try_get("created_at")? };
    let personal = r.try_get::<String, _>("personal")? == org.id;
    Ok(Membership { role: parse_role(&r.try_get::<String, _>("role")?)?, personal, org })
}
