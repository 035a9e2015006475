//! Taking money: the `PaymentProcessor` a deployment plugs in, and the local
//! development processor `tessera serve` uses.
//!
//! A processor knows each payment method's kind: plans renew every month, so they need
//! a recurring method (a card); one-time methods (crypto) can buy credits only.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MethodKind {
    /// Can be charged again without the payer (cards): plans and credits.
    Recurring,
    /// Paid once by the payer (crypto): credits only.
    OneTime,
}

/// One charge. `idempotency_key` names it: asking again with the same key returns the
/// first charge's receipt and takes nothing more.
#[derive(Debug, Clone)]
pub struct Charge {
    pub idempotency_key: String,
    pub method: String,
    pub amount_micros: i64,
    pub description: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Receipt {
    /// The processor's reference for the charge.
    pub reference: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PaymentError {
    #[error("unknown payment method {0:?}")]
    UnknownMethod(String),
    #[error("the payment was declined: {0}")]
    Declined(String),
    #[error("payment processor: {0}")]
    Unavailable(String),
}

pub type PaymentFuture<'a> = Pin<Box<dyn Future<Output = Result<Receipt, PaymentError>> + Send + 'a>>;

/// A payment method a payer can choose in the console.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Method {
    pub id: String,
    /// What the payer sees: `Visa •••• 4242`.
    pub label: String,
    pub kind: MethodKind,
}

pub trait PaymentProcessor: Send + Sync {
    /// The kind of a payment method, or None if the processor does not know it.
    fn method_kind(&self, method: &str) -> Option<MethodKind>;

    /// The methods the console offers. (A real processor lists the payer's saved
    /// methods and adds new ones in its own hosted form.)
    fn methods(&self) -> Vec<Method>;

    fn charge<'a>(&'a self, charge: &'a Charge) -> PaymentFuture<'a>;

    /// Gives a charge back in full (one that paid for nothing: its plan change lost a
    /// race with another).
    fn refund<'a>(&'a self, reference: &'a str) -> PaymentFuture<'a>;
}

/// A stand-in processor for development and tests: no real payment processor can run
/// here. Its methods: `pm_dev_card` (recurring, always succeeds), `pm_dev_crypto`
/// (one-time, always succeeds), `pm_dev_card_declined` (recurring, always declined),
/// `pm_dev_card_unreachable` (recurring; the processor never answers for it).
/// It remembers charges by idempotency key, as real processors do.
#[derive(Default)]
pub struct DevProcessor {
    charged: Mutex<HashMap<String, Receipt>>,
    refunded: Mutex<Vec<String>>,
}

impl DevProcessor {
    /// The references of the charges refunded so far.
    pub fn refunded(&self) -> Vec<String> {
        self.refunded.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

pub const DEV_CARD: &str = "pm_dev_card";
pub const DEV_CRYPTO: &str = "pm_dev_crypto";
pub const DEV_CARD_DECLINED: &str = "pm_dev_card_declined";
pub const DEV_CARD_UNREACHABLE: &str = "pm_dev_card_unreachable";

impl PaymentProcessor for DevProcessor {
    fn method_kind(&self, method: &str) -> Option<MethodKind> {
        match method {
            DEV_CARD | DEV_CARD_DECLINED | DEV_CARD_UNREACHABLE => Some(MethodKind::Recurring),
            DEV_CRYPTO => Some(MethodKind::OneTime),
            _ => None,
        }
    }

    fn methods(&self) -> Vec<Method> {
        let method = |id: &str, label: &str, kind| Method { id: id.into(), label: label.into(), kind };
        vec![
            method(DEV_CARD, "Development card (always paid)", MethodKind::Recurring),
            method(DEV_CRYPTO, "Development crypto wallet (one-time)", MethodKind::OneTime),
            method(DEV_CARD_DECLINED, "Development card that is always declined", MethodKind::Recurring),
            method(DEV_CARD_UNREACHABLE, "Development card whose processor never answers", MethodKind::Recurring),
        ]
    }

    fn charge<'a>(&'a self, charge: &'a Charge) -> PaymentFuture<'a> {
        Box::pin(async move {
            match self.method_kind(&charge.method) {
                None => return Err(PaymentError::UnknownMethod(charge.method.clone())),
                Some(_) if charge.method == DEV_CARD_DECLINED => {
                    return Err(PaymentError::Declined("the development card that always declines".into()));
                }
                Some(_) if charge.method == DEV_CARD_UNREACHABLE => {
                    return Err(PaymentError::Unavailable("the development processor did not answer".into()));
                }
                Some(_) => {}
            }
            let mut charged = self.charged.lock().unwrap_or_else(|e| e.into_inner());
            let receipt = charged
                .entry(charge.idempotency_key.clone())
                .or_insert_with(|| Receipt { reference: crate::accounts::keys::random_id("ch_dev_") });
            Ok(receipt.clone())
        })
    }

    fn refund<'a>(&'a self, reference: &'a str) -> PaymentFuture<'a> {
        Box::pin(async move {
            let known =
                self.charged.lock().unwrap_or_else(|e| e.into_inner()).values().any(|r| r.reference == reference);
            if !known {
                return Err(PaymentError::Unavailable(format!("no charge {reference} to refund")));
            }
            self.refunded.lock().unwrap_or_else(|e| e.into_inner()).push(reference.to_string());
            Ok(Receipt { reference: format!("re_{reference}") })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_dev_processor_knows_its_methods_and_charges_once_per_key() {
        let p = DevProcessor::default();
        assert_eq!(p.method_kind(DEV_CARD), Some(MethodKind::Recurring));
        assert_eq!(p.method_kind(DEV_CRYPTO), Some(MethodKind::OneTime));
        assert_eq!(p.method_kind("pm_other"), None);
        let charge = |key: &str, method: &str| Charge {
            idempotency_key: key.into(),
            method: method.into(),
            amount_micros: 5,
            description: String::new(),
        };
        let first = p.charge(&charge("k1", DEV_CARD)).await.unwrap();
        assert_eq!(p.charge(&charge("k1", DEV_CARD)).await.unwrap(), first, "same key, same charge");
        assert_ne!(p.charge(&charge("k2", DEV_CARD)).await.unwrap(), first);
        assert!(matches!(p.charge(&charge("k3", DEV_CARD_DECLINED)).await, Err(PaymentError::Declined(_))));
        assert!(matches!(p.charge(&charge("k4", "pm_nope")).await, Err(PaymentError::UnknownMethod(_))));
        p.refund(&first.reference).await.unwrap();
        assert_eq!(p.refunded(), [first.reference]);
        assert!(p.refund("ch_unknown").await.is_err());
    }
}
