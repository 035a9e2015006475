//! Which worker serves a model. `tessera serve` has one replica per distinct weights,
//! started locally; the cluster issue replaces this static table with etcd placement
//! and load-aware choice.

pub mod choice;
pub mod replica;

pub use replica::{Replica, ReplicaError};

use crate::catalog::{Catalog, CatalogModel};
use std::collections::BTreeMap;
use std::sync::Arc;
use tessera_proto::chat_template::ChatTemplate;

/// A catalog model and the replica serving it.
pub struct ServedModel {
    pub entry: CatalogModel,
    pub replica: Arc<Replica>,
    /// The family's template from the catalog, else the one that came with the weights.
    pub template: Option<Arc<ChatTemplate>>,
}

impl ServedModel {
    /// The longest prompt plus completion a request may ask for: the catalog's limit,
    /// or the served weights' if smaller.
    pub fn context_length(&self) -> u32 {
        self.entry.context_length.min(self.replica.card.context_length)
    }
}

#[derive(Default)]
pub struct Models {
    by_id: BTreeMap<String, Arc<ServedModel>>,
}

impl Models {
    /// Every catalog model whose weights have a replica; an error names a catalog
    /// template that does not compile.
    pub fn new(catalog: &Catalog, replicas: &BTreeMap<String, Arc<Replica>>) -> Result<Self, String> {
        let mut by_id = BTreeMap::new();
        for m in &catalog.models {
            let Some(replica) = replicas.get(&m.weights).cloned() else { continue };
            let template = match &m.chat_template_source {
                Some(source) => {
                    let card = &replica.card;
                    let t = ChatTemplate::new(source, &card.bos_token, &card.eos_token)
                        .map_err(|e| format!("{}: chat template: {e}", m.id))?;
                    Some(Arc::new(t))
                }
                None => replica.template.clone(),
            };
            by_id.insert(m.id.clone(), Arc::new(ServedModel { entry: m.clone(), replica, template }));
        }
        Ok(Self { by_id })
    }

    /// Exactly the full id; `model-a` alone is not `vendor-a/model-a`.
    pub fn get(&self, id: &str) -> Option<Arc<ServedModel>> {
        self.by_id.get(id).cloned()
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<ServedModel>> {
        self.by_id.values()
    }
}
