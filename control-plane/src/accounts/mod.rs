//! Organizations, people and API keys: the secrets' format and the SQL store, with the
//! console's memberships, sessions and invites beside it.

pub mod invites;
pub mod keys;
pub mod people;
pub mod sessions;
pub mod store;

pub use invites::{Acceptance, Invite, InviteState};
pub use people::{Member, MemberChange, Membership, Role};
pub use sessions::{Lifetimes, LinkPurpose, Session};
pub use store::{ApiKey, BillingMode, NewKey, Org, Store, StoreError, User};
