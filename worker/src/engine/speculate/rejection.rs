//! Rejection sampling of a proposal drawn from a distribution (Leviathan et al., 2023;
//! Chen et al., 2023): a proposed token `d ~ q` is kept with probability
//! `min(1, p(d) / q(d))`, and otherwise replaced by a token drawn from the residual
//! `max(0, p − q)`, normalised. Whatever `q` is, the emitted token is distributed as
//! `p`, the target's: `P(t) = q(t)·min(1, p(t)/q(t)) + P(reject)·residual(t) = p(t)`.
//!
//! A proposer that guesses single tokens has `q` = 1 at its guess: the guess is kept
//! with probability `p(d)`, and the residual is `p` without `d`. The engine's
//! verification (`EngineCore::verify`) gets exactly that by drawing the target's token
//! as it would without speculation and keeping the guess when they agree — the same
//! distribution, and the same tokens for a seeded request. This function is for
//! proposals with a distribution of their own.

/// The token to emit where `draft` (drawn from `q`) was proposed, and whether it is the
/// proposal. `p` and `q` are distributions over the vocabulary (the request's filters
/// applied to both); `accept` and `resample` are uniform draws in [0, 1).
pub fn verify(p: &[f32], q: &[f32], draft: u32, accept: f32, resample: f32) -> (u32, bool) {
    verify_with(p, q, draft, accept, resample, Residual::Exact)
}

/// What a rejection draws from: the residual, or (only to show a test fails without
/// it) the target distribution itself.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Residual {
    Exact,
    #[cfg(test)]
    TargetInstead,
}

fn verify_with(p: &[f32], q: &[f32], draft: u32, accept: f32, resample: f32, residual: Residual) -> (u32, bool) {
    let d = draft as usize;
    let (pd, qd) = (f64::from(p[d]), f64::from(q[d]));
    // u < p/q, without dividing (a proposal q gave no weight is kept if p gives it any).
    let keep = if qd > 0.0 { f64::from(accept) * qd < pd } else { pd > 0.0 };
    if keep {
        return (draft, true);
    }
    let weights: Vec<f64> = match residual {
        Residual::Exact => p.iter().zip(q).map(|(&p, &q)| (f64::from(p) - f64::from(q)).max(0.0)).collect(),
        #[cfg(test)]
        Residual::TargetInstead => p.iter().map(|&p| f64::from(p)).collect(),
    };
    let total: f64 = weights.iter().sum();
    // Rounding can leave no residual where p ≈ q: then p itself.
    let weights = if total > 0.0 { weights } else { p.iter().map(|&p| f64::from(p)).collect() };
    let total: f64 = weights.iter().sum();
    let target = f64::from(resample) * total;
    let mut mass = 0.0;
    for (t, w) in weights.iter().enumerate() {
        mass += w;
        if mass > target && *w > 0.0 {
            return (t as u32, t == d);
        }
    }
    let last = weights.iter().rposition(|&w| w > 0.0).unwrap_or(0);
    (last as u32, last == d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const P: [f32; 6] = [0.35, 0.25, 0.15, 0.12, 0.08, 0.05];
    const Q: [f32; 6] = [0.10, 0.40, 0.05, 0.25, 0.15, 0.05];

    fn draw(dist: &[f32], u: f32) -> u32 {
        let mut mass = 0.0;
        for (t, &w) in dist.iter().enumerate() {
            mass += w;
            if u < mass {
                return t as u32;
            }
        }
        dist.len() as u32 - 1
    }

    /// Pearson's chi-square of `counts` against `expected` probabilities.
    fn chi_square(counts: &[u64], expected: &[f32]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(expected)
            .map(|(&c, &p)| (c as f64 - n as f64 * f64::from(p)).powi(2) / (n as f64 * f64::from(p)))
            .sum()
    }

    fn emitted(residual: Residual, q: &[f32]) -> (Vec<u64>, f64) {
        let mut rng = StdRng::seed_from_u64(11);
        let mut counts = vec![0u64; P.len()];
        let mut kept = 0;
        let n = 200_000;
        for _ in 0..n {
            let d = draw(q, rng.random());
            let (t, accepted) = verify_with(&P, q, d, rng.random(), rng.random(), residual);
            counts[t as usize] += 1;
            kept += u64::from(accepted);
        }
        (counts, kept as f64 / n as f64)
    }

    /// Chi-square's 0.999 quantile at 5 degrees of freedom: a correct sampler exceeds
    /// it one run in a thousand (and this one's seed is fixed).
    const CRITICAL_5_DOF: f64 = 20.52;

    #[test]
    fn emitted_tokens_follow_the_target_whatever_the_proposals() {
        let (counts, kept) = emitted(Residual::Exact, &Q);
        let x2 = chi_square(&counts, &P);
        assert!(x2 < CRITICAL_5_DOF, "chi-square {x2}: {counts:?}");
        // Acceptance is Σ min(p, q) = 0.1 + 0.25 + 0.05 + 0.12 + 0.08 + 0.05 = 0.65.
        assert!((kept - 0.65).abs() < 0.01, "{kept}");
        // A point-mass proposal (a guessed token) too: kept with probability p(d).
        let point = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0];
        let (counts, kept) = emitted(Residual::Exact, &point);
        assert!(chi_square(&counts, &P) < CRITICAL_5_DOF, "{counts:?}");
        assert!((kept - 0.15).abs() < 0.01, "{kept}");
    }

    #[test]
    fn without_the_residual_the_test_fails() {
        let (counts, _) = emitted(Residual::TargetInstead, &Q);
        let x2 = chi_square(&counts, &P);
        assert!(x2 > 100.0 * CRITICAL_5_DOF, "chi-square {x2}: resampling from p is biased");
    }

    #[test]
    fn equal_distributions_keep_every_proposal() {
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..1000 {
            let d = draw(&P, rng.random());
            assert_eq!(verify(&P, &P, d, rng.random(), rng.random()), (d, true));
        }
    }
}
