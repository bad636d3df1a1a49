//! Latency histograms with fixed buckets: constant memory however many
//! requests are served, rendered as Prometheus histograms (cumulative
//! `_bucket{le=...}` lines ending at `+Inf`, `_sum`, `_count`) and
//! summarized for `/stats` (count, mean, and p50/p90/p99 estimated from the
//! buckets the way Prometheus' `histogram_quantile` does).

use std::fmt::Write;
use std::sync::Mutex;

/// Upper bounds in seconds, from half a millisecond (a fast decode step) to
/// ten minutes (a long queue wait).
const BOUNDS: [f64; 27] = [
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0,
];

/// Observations so far: a count per bucket (the last one is `+Inf`), their
/// sum, and the smallest and largest seen (they bound the estimates).
#[derive(Debug, Clone, PartialEq)]
struct Counts {
    buckets: [u64; BOUNDS.len() + 1],
    count: u64,
    sum: f64,
    min: f64,
    max: f64,
}

impl Default for Counts {
    fn default() -> Self {
        Counts {
            buckets: [0; BOUNDS.len() + 1],
            count: 0,
            sum: 0.0,
            min: f64::INFINITY,
            max: 0.0,
        }
    }
}

/// A histogram of durations in seconds; safe to share between threads.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: Mutex<Counts>,
}

/// What `/stats` shows of a histogram; the estimates are `None` before the
/// first observation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    pub count: u64,
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
}

impl Histogram {
    /// Records one duration; negative or non-finite values are ignored.
    pub fn observe(&self, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let idx = BOUNDS.partition_point(|&b| b < seconds);
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.buckets[idx] += 1;
        c.count += 1;
        c.sum += seconds;
        c.min = c.min.min(seconds);
        c.max = c.max.max(seconds);
    }

    fn snapshot(&self) -> Counts {
        self.counts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Count, mean and the 50th, 90th and 99th percentiles.
    pub fn summary(&self) -> Summary {
        let c = self.snapshot();
        let some = |v: f64| (c.count > 0).then_some(v);
        Summary {
            count: c.count,
            mean: some(c.sum / c.count.max(1) as f64),
            p50: some(quantile(&c, 0.50)),
            p90: some(quantile(&c, 0.90)),
            p99: some(quantile(&c, 0.99)),
        }
    }

    /// Appends the Prometheus text of this histogram as `name` with the
    /// label `model`.
    pub fn render(&self, out: &mut String, name: &str, help: &str, model: &str) {
        let c = self.snapshot();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, n) in c.buckets.iter().enumerate() {
            cumulative += n;
            let le = BOUNDS
                .get(i)
                .map_or("+Inf".to_string(), |b| format!("{b:?}"));
            let _ = writeln!(
                out,
                "{name}_bucket{{model=\"{model}\",le=\"{le}\"}} {cumulative}"
            );
        }
        let _ = writeln!(out, "{name}_sum{{model=\"{model}\"}} {}", c.sum);
        let _ = writeln!(out, "{name}_count{{model=\"{model}\"}} {}", c.count);
    }
}

/// The `q` quantile: the rank `q * count` found in its bucket and
/// interpolated linearly inside it, clamped to what was observed.
fn quantile(c: &Counts, q: f64) -> f64 {
    let rank = q * c.count as f64;
    let mut below = 0u64;
    for (i, &n) in c.buckets.iter().enumerate() {
        if n > 0 && (below + n) as f64 >= rank {
            let lower = if i == 0 { 0.0 } else { BOUNDS[i - 1] };
            let upper = BOUNDS.get(i).copied().unwrap_or(c.max);
            let within = ((rank - below as f64) / n as f64).clamp(0.0, 1.0);
            return (lower + (upper - lower) * within).clamp(c.min, c.max);
        }
        below += n;
    }
    c.max
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_end_at_inf() {
        let h = Histogram::default();
        for s in [0.0004, 0.003, 0.003, 2.0, 5000.0] {
            h.observe(s);
        }
        h.observe(-1.0);
        h.observe(f64::NAN);
        let mut out = String::new();
        h.render(&mut out, "t_seconds", "Test.", "m");
        assert!(out.contains("# TYPE t_seconds histogram"), "{out}");
        assert!(out.contains("t_seconds_bucket{model=\"m\",le=\"0.0005\"} 1\n"));
        assert!(out.contains("t_seconds_bucket{model=\"m\",le=\"0.0025\"} 1\n"));
        assert!(out.contains("t_seconds_bucket{model=\"m\",le=\"0.005\"} 3\n"));
        assert!(out.contains("t_seconds_bucket{model=\"m\",le=\"2.5\"} 4\n"));
        assert!(out.contains("t_seconds_bucket{model=\"m\",le=\"600.0\"} 4\n"));
        assert!(out.contains("t_seconds_bucket{model=\"m\",le=\"+Inf\"} 5\n"));
        assert!(out.contains("t_seconds_count{model=\"m\"} 5\n"));
        let sum: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix("t_seconds_sum{model=\"m\"} "))
            .and_then(|v| v.parse().ok())
            .expect("a _sum line");
        assert!((sum - 5002.0064).abs() < 1e-9, "{out}");
        let counts: Vec<u64> = out
            .lines()
            .filter(|l| l.starts_with("t_seconds_bucket"))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        assert_eq!(counts.len(), BOUNDS.len() + 1);
        assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    }

    #[test]
    fn summary_estimates_from_buckets() {
        let h = Histogram::default();
        assert_eq!(h.summary().count, 0);
        assert_eq!(h.summary().p50, None);
        for i in 0..100 {
            // 90 fast observations around 10 ms, 10 slow ones at 1.5 s.
            h.observe(if i < 90 { 0.009 } else { 1.5 });
        }
        let s = h.summary();
        assert_eq!(s.count, 100);
        let mean = s.mean.unwrap();
        assert!((mean - (0.9 * 0.009 + 0.1 * 1.5)).abs() < 1e-9, "{mean}");
        let p50 = s.p50.unwrap();
        assert!((0.0075..=0.01).contains(&p50), "{p50}");
        let p90 = s.p90.unwrap();
        assert!((0.0075..=0.01).contains(&p90), "{p90}");
        let p99 = s.p99.unwrap();
        assert!((1.0..=1.5).contains(&p99), "{p99}");
        // One observation: every estimate is that value.
        let one = Histogram::default();
        one.observe(0.042);
        let s = one.summary();
        assert_eq!((s.p50, s.p99), (Some(0.042), Some(0.042)));
    }
}
