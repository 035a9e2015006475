//! Which worker serves a model: each catalog model has the pool of replicas serving its
//! weights (`pool`), which picks one per request by prefix cache and load (`choice`).
//! `tessera serve` puts one local replica in each pool; cluster mode fills them from
//! etcd.

pub mod choice;
pub mod pool;
pub mod replica;

pub use pool::{Dispatch, Pool, PoolError, Stage};
pub use replica::{Replica, ReplicaError};

use crate::catalog::{Catalog, CatalogModel};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use tessera_proto::chat_template::ChatTemplate;

/// A catalog model's chat template that does not compile.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{model}: chat template: {message}")]
pub struct TemplateError {
    pub model: String,
    pub message: String,
}

/// A catalog model and the replicas serving it.
pub struct ServedModel {
    pub entry: CatalogModel,
    /// One replica of the weights, for what every replica shares: tokenizer, card,
    /// template, token bytes.
    pub replica: Arc<Replica>,
    /// Where its requests go.
    pub pool: Arc<Pool>,
    /// The family's template from the catalog, else the one that came with the weights.
    pub template: Option<Arc<ChatTemplate>>,
}

impl ServedModel {
    /// How the model reads images, when its weights do.
    pub fn vision(&self) -> Option<crate::chat::vision::Vision> {
        self.replica.card.vision.clone().map(crate::chat::vision::Vision::new)
    }

    /// The model served by `pool`, `replica` being one of its replicas; an error names a
    /// catalog template that does not compile.
    pub fn new(entry: CatalogModel, replica: Arc<Replica>, pool: Arc<Pool>) -> Result<Self, TemplateError> {
        let template = match &entry.chat_template_source {
            Some(source) => {
                let card = &replica.card;
                let t = ChatTemplate::new(source, &card.bos_token, &card.eos_token)
                    .map_err(|e| TemplateError { model: entry.id.clone(), message: e.to_string() })?;
                Some(Arc::new(t))
            }
            None => replica.template.clone(),
        };
        Ok(Self { entry, replica, pool, template })
    }

    /// The longest prompt plus completion a request may ask for: the catalog's limit,
    /// or the least of the replicas' (their weights' context, capped at what their KV
    /// cache holds) if smaller.
    pub fn context_length(&self) -> u32 {
        let served = self.pool.context_length().unwrap_or(self.replica.card.context_length);
        self.entry.context_length.min(served)
    }
}

/// The served models, by id. Fixed at start in `tessera serve`; in cluster mode a model
/// appears once the first replica of it is ready.
#[derive(Default)]
pub struct Models {
    by_id: RwLock<BTreeMap<String, Arc<ServedModel>>>,
    /// Models that will be served once a replica is ready (cluster mode's catalog):
    /// until then a request for one is told to come back (503), not that it does not
    /// exist. By id, with their display names.
    expected: BTreeMap<String, String>,
}

impl Models {
    /// Every catalog model whose weights have a pool (and a replica of them, for
    /// metadata); an error names a catalog template that does not compile.
    pub fn new(catalog: &Catalog, pools: &BTreeMap<String, (Arc<Replica>, Arc<Pool>)>) -> Result<Self, TemplateError> {
        let models = Self::default();
        for m in &catalog.models {
            let Some((replica, pool)) = pools.get(&m.weights).cloned() else { continue };
            models.insert(ServedModel::new(m.clone(), replica, pool)?);
        }
        Ok(models)
    }

    /// None served yet; `expected` are the models (id, display name) that may be.
    pub fn expecting(expected: impl IntoIterator<Item = (String, String)>) -> Self {
        Self { by_id: RwLock::default(), expected: expected.into_iter().collect() }
    }

    /// Whether `id` is a model that is not served yet but will be.
    pub fn is_expected(&self, id: &str) -> bool {
        self.expected.contains_key(id) && self.get(id).is_none()
    }

    /// The models GET /status reports: those served and those expected, by id.
    pub fn listed(&self) -> Vec<crate::status::Listed> {
        let mut all = self.expected.clone();
        for m in self.all() {
            all.insert(m.entry.id.clone(), m.entry.name.clone());
        }
        all.into_iter().map(|(id, name)| crate::status::Listed { id, name }).collect()
    }

    pub fn insert(&self, model: ServedModel) {
        self.by_id.write().unwrap_or_else(|e| e.into_inner()).insert(model.entry.id.clone(), Arc::new(model));
    }

    /// Exactly the full id; `model-a` alone is not `vendor-a/model-a`.
    pub fn get(&self, id: &str) -> Option<Arc<ServedModel>> {
        self.by_id.read().unwrap_or_else(|e| e.into_inner()).get(id).cloned()
    }

    /// The listed model a mistyped `id` meant, when only one can be: the one whose id
    /// is it, case aside, or ends in `/` and it (`model-c` for `vendor-c/model-c`).
    pub fn meant(&self, id: &str) -> Option<String> {
        let id = id.trim().to_ascii_lowercase();
        let mut candidates = self.listed().into_iter().map(|l| l.id).filter(|full| {
            let full = full.to_ascii_lowercase();
            full == id || full.rsplit_once('/').is_some_and(|(_, name)| name == id)
        });
        let first = candidates.next();
        if candidates.next().is_some() { None } else { first }
    }

    pub fn all(&self) -> Vec<Arc<ServedModel>> {
        self.by_id.read().unwrap_or_else(|e| e.into_inner()).values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_or_miscased_name_points_at_the_full_id() {
        let models = Models::expecting([
            ("vendor-a/model-a".to_string(), "A".to_string()),
            ("vendor-c/model-c".to_string(), "C".to_string()),
        ]);
        assert_eq!(models.meant("model-c").as_deref(), Some("vendor-c/model-c"));
        assert_eq!(models.meant("Vendor-A/Model-A").as_deref(), Some("vendor-a/model-a"));
        assert_eq!(models.meant("model-z"), None);
        assert_eq!(models.meant("vendor-c"), None);
        let two = Models::expecting([
            ("vendor-a/model-x".to_string(), "A".to_string()),
            ("vendor-b/model-x".to_string(), "B".to_string()),
        ]);
        assert_eq!(two.meant("model-x"), None, "no guess between two");
    }
}
