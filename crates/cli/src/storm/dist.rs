//! Latency distributions drawn from the simulation's seeded generator.

use std::time::Duration;

use rand::{Rng, RngExt};

/// The standard normal quantile at 0.99.
const Z99: f64 = 2.326_347_874;
/// The standard normal quantile at 0.95.
const Z95: f64 = 1.644_853_627;

/// A log-normal latency given by its mean and its p99, the two figures an incident report
/// quotes ("600 ms mean, 1.5 s p99").
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct LogNormal {
    /// Mean of the underlying normal (of `ln x`, x in seconds).
    mu: f64,
    /// Standard deviation of the underlying normal.
    sigma: f64,
    mean: Duration,
}

/// A mean and p99 no log-normal has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "no log-normal has mean {mean:?} and p99 {p99:?}: the p99 must lie above the mean and below about 15 times it"
)]
pub(crate) struct LogNormalError {
    mean: Duration,
    p99: Duration,
}

impl LogNormal {
    /// The log-normal with this mean and p99.
    ///
    /// With `ln x ~ N(mu, sigma)`: `mean = exp(mu + sigma^2 / 2)` and
    /// `p99 = exp(mu + z99 sigma)`, so `sigma^2 / 2 - z99 sigma + ln(p99 / mean) = 0`; the
    /// smaller root is the one whose p99 grows with sigma.
    pub(crate) fn new(mean: Duration, p99: Duration) -> Result<Self, LogNormalError> {
        let err = LogNormalError { mean, p99 };
        if mean.is_zero() || p99 <= mean {
            return Err(err);
        }
        let gap = (p99.as_secs_f64() / mean.as_secs_f64()).ln();
        let disc = Z99 * Z99 - 2.0 * gap;
        if disc < 0.0 {
            return Err(err);
        }
        let sigma = Z99 - disc.sqrt();
        let mu = mean.as_secs_f64().ln() - sigma * sigma / 2.0;
        Ok(Self { mu, sigma, mean })
    }

    /// The configured mean.
    pub(crate) fn mean(&self) -> Duration {
        self.mean
    }

    /// The 95th percentile.
    pub(crate) fn p95(&self) -> Duration {
        Duration::from_secs_f64((self.mu + Z95 * self.sigma).exp())
    }

    /// One draw, in nanoseconds.
    pub(crate) fn sample_nanos<R: Rng + ?Sized>(&self, rng: &mut R) -> u64 {
        let x = (self.mu + self.sigma * standard_normal(rng)).exp();
        // Capped at an hour: a draw that far out is a numerical accident, not a latency.
        (x.min(3_600.0) * 1e9) as u64
    }
}

/// A standard normal draw (Box-Muller; the second value is dropped to keep the generator's
/// use simple and deterministic).
fn standard_normal<R: Rng + ?Sized>(rng: &mut R) -> f64 {
    // `1 - u` lies in (0, 1], so the logarithm is finite.
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// An exponential draw with `rate` per second, in nanoseconds: Poisson inter-arrival times.
pub(crate) fn exponential_nanos<R: Rng + ?Sized>(rng: &mut R, rate: f64) -> u64 {
    let u: f64 = 1.0 - rng.random::<f64>();
    (-u.ln() / rate * 1e9) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn draws_have_the_configured_mean_and_p99() {
        let d = LogNormal::new(Duration::from_millis(560), Duration::from_millis(1460)).unwrap();
        let mut rng = StdRng::seed_from_u64(1);
        let mut xs: Vec<u64> = (0..200_000).map(|_| d.sample_nanos(&mut rng)).collect();
        let mean = xs.iter().map(|&x| x as f64).sum::<f64>() / xs.len() as f64 / 1e9;
        xs.sort_unstable();
        let p99 = xs[xs.len() * 99 / 100] as f64 / 1e9;
        assert!((mean - 0.560).abs() < 0.01, "{mean}");
        assert!((p99 - 1.460).abs() < 0.05, "{p99}");
    }

    #[test]
    fn impossible_shapes_are_rejected() {
        let ms = Duration::from_millis;
        assert!(LogNormal::new(ms(100), ms(100)).is_err());
        assert!(LogNormal::new(ms(100), ms(50)).is_err());
        assert!(LogNormal::new(Duration::ZERO, ms(50)).is_err());
        assert!(LogNormal::new(ms(100), ms(100_000)).is_err());
    }

    #[test]
    fn exponential_mean_is_one_over_the_rate() {
        let mut rng = StdRng::seed_from_u64(2);
        let n = 100_000;
        let mean = (0..n)
            .map(|_| exponential_nanos(&mut rng, 2000.0) as f64)
            .sum::<f64>()
            / n as f64;
        assert!((mean / 1e9 - 0.0005).abs() < 0.00002, "{mean}");
    }
}
