//! What tokens cost: the catalog's prices (micro-dollars per million tokens) applied to
//! a request's counts, rounded once, to the nearest micro-dollar.

use crate::catalog::Prices;

/// A request's token counts as the worker reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    pub prompt: u64,
    /// Of `prompt`, those served from the prefix cache.
    pub cached: u64,
    /// Every generated token, reasoning included.
    pub completion: u64,
}

/// Uncached prompt tokens at the input price, cached ones at the cache-read price (the
/// input price where the model has none), completion tokens at the output price.
pub fn cost_micros(prices: &Prices, t: Tokens) -> u64 {
    let cached = t.cached.min(t.prompt);
    let cache_price = prices.cache_read.unwrap_or(prices.input);
    // In micro-dollars × 1e6: u128, so that no count times no price can overflow.
    let scaled = (t.prompt - cached) as u128 * prices.input as u128
        + cached as u128 * cache_price as u128
        + t.completion as u128 * prices.output as u128;
    ((scaled + 500_000) / 1_000_000) as u64
}

/// Micro-dollars as dollars for people: `$1.250000`.
pub fn usd(micros: i64) -> String {
    let sign = if micros < 0 { "-" } else { "" };
    format!("{sign}${}.{:06}", micros.unsigned_abs() / 1_000_000, micros.unsigned_abs() % 1_000_000)
}

/// Dollars as typed by an operator (`12.5`) in micro-dollars, exactly to the micro-dollar.
pub fn usd_to_micros(usd: f64) -> anyhow::Result<u64> {
    anyhow::ensure!(usd.is_finite() && usd >= 0.0, "an amount in dollars must be zero or more, not {usd}");
    let micros = (usd * 1_000_000.0).round();
    anyhow::ensure!(micros < i64::MAX as f64, "{usd} dollars is more than the ledger holds");
    Ok(micros as u64)
}

/// The most a request can cost: its whole prompt uncached and every token it may
/// generate.
pub fn worst_case_micros(prices: &Prices, prompt: u64, max_completion: u64) -> u64 {
    let cache_price = prices.cache_read.unwrap_or(prices.input);
    let prompt_price = prices.input.max(cache_price);
    let scaled = prompt as u128 * prompt_price as u128 + max_completion as u128 * prices.output as u128;
    // Rounded up: a hold never falls short of the cost it covers.
    scaled.div_ceil(1_000_000) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Prices = Prices { input: 700_000, cache_read: Some(160_000), output: 3_500_000 };
    const C: Prices = Prices { input: 110_000, cache_read: None, output: 350_000 };

    #[test]
    fn prices_apply_per_kind_of_token() {
        // 1M uncached input tokens of Model A cost $0.70.
        assert_eq!(cost_micros(&A, Tokens { prompt: 1_000_000, cached: 0, completion: 0 }), 700_000);
        // 100 prompt tokens (40 cached) and 50 completion tokens:
        // 60 × 0.70 + 40 × 0.16 + 50 × 3.50 = 42 + 6.4 + 175 = 223.4 → 223 micro-dollars.
        assert_eq!(cost_micros(&A, Tokens { prompt: 100, cached: 40, completion: 50 }), 223);
        // Model C has no cache-read price: cached tokens cost the input price.
        let c = Tokens { prompt: 100, cached: 40, completion: 0 };
        assert_eq!(cost_micros(&C, c), cost_micros(&C, Tokens { cached: 0, ..c }));
        assert_eq!(cost_micros(&A, Tokens::default()), 0);
    }

    #[test]
    fn the_worst_case_covers_every_outcome() {
        for (prompt, max) in [(1, 1), (100, 50), (8000, 192), (3, 0)] {
            let worst = worst_case_micros(&A, prompt, max);
            for cached in [0, prompt / 2, prompt] {
                for completion in [0, max / 2, max] {
                    let cost = cost_micros(&A, Tokens { prompt, cached, completion });
                    assert!(cost <= worst, "{prompt}/{cached}/{completion}: {cost} > {worst}");
                }
            }
        }
        assert_eq!(worst_case_micros(&A, 1, 0), 1, "rounded up");
    }

    #[test]
    fn dollars_both_ways() {
        assert_eq!(usd_to_micros(100.0).unwrap(), 100_000_000);
        assert_eq!(usd_to_micros(0.000001).unwrap(), 1);
        assert_eq!(usd_to_micros(12.345678).unwrap(), 12_345_678);
        assert!(usd_to_micros(-1.0).is_err() && usd_to_micros(f64::NAN).is_err());
        assert_eq!(usd(1_250_000), "$1.250000");
        assert_eq!(usd(-5), "-$0.000005");
    }
}
