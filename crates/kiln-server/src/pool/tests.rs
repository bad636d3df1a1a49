use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

/// A loaded "model" that counts its loads and drops.
struct Fake {
    counts: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    loads: AtomicUsize,
    drops: AtomicUsize,
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.counts.drops.fetch_add(1, Ordering::SeqCst);
    }
}

fn source(name: &str, mib: u64, counts: &Arc<Counts>) -> ModelSource<Fake> {
    let counts = counts.clone();
    ModelSource {
        name: name.into(),
        device: "cpu".into(),
        memory_bytes: mib << 20,
        pinned: false,
        path: PathBuf::from(format!("/models/{name}")),
        load: Arc::new(move || {
            counts.loads.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20));
            Ok(Fake {
                counts: counts.clone(),
            })
        }),
    }
}

fn config(budget_mib: u64) -> PoolConfig {
    PoolConfig {
        budgets: [("cpu".to_string(), budget_mib << 20)].into(),
        idle_unload: None,
        wait: Duration::from_millis(500),
        retry_after_failure: Duration::from_millis(100),
    }
}

fn states(pool: &ModelPool<Fake>) -> Vec<(String, &'static str)> {
    pool.list()
        .into_iter()
        .map(|s| (s.name, s.state.as_str()))
        .collect()
}

fn state_of(pool: &ModelPool<Fake>, name: &str) -> ModelState {
    pool.list()
        .into_iter()
        .find(|s| s.name == name)
        .map(|s| s.state)
        .unwrap()
}

/// Waits until the evicted values have been dropped on their thread.
async fn settle(counts: &Counts, drops: usize) {
    for _ in 0..200 {
        if counts.drops.load(Ordering::SeqCst) >= drops {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!(
        "expected {drops} drops, saw {}",
        counts.drops.load(Ordering::SeqCst)
    );
}

#[tokio::test]
async fn loads_on_first_request_and_once_for_concurrent_ones() {
    let c = Arc::new(Counts::default());
    let pool = ModelPool::new(
        vec![source("a", 10, &c), source("b", 10, &c)],
        None,
        config(100),
    )
    .unwrap();
    assert_eq!(
        states(&pool),
        [("a".into(), "unloaded"), ("b".into(), "unloaded")]
    );
    let (x, y, z) = tokio::join!(pool.acquire("a"), pool.acquire("a"), pool.acquire("a"));
    let (x, y, z) = (x.unwrap(), y.unwrap(), z.unwrap());
    assert!(Arc::ptr_eq(x.value(), y.value()) && Arc::ptr_eq(y.value(), z.value()));
    assert_eq!(c.loads.load(Ordering::SeqCst), 1);
    let listed = pool.list();
    assert_eq!(listed[0].state, ModelState::Loaded);
    assert_eq!(listed[0].in_flight, 3);
    assert_eq!(listed[1].state, ModelState::Unloaded);
    drop((x, y, z));
    assert_eq!(pool.list()[0].in_flight, 0);
    assert_eq!(pool.default_name(), "a");
}

#[tokio::test]
async fn the_least_recently_used_idle_model_makes_room() {
    let c = Arc::new(Counts::default());
    let sources = vec![
        source("a", 40, &c),
        source("b", 40, &c),
        source("c", 40, &c),
    ];
    let pool = ModelPool::new(sources, None, config(100)).unwrap();
    drop(pool.acquire("a").await.unwrap());
    drop(pool.acquire("b").await.unwrap());
    // `a` used last: `b` is the one to go.
    drop(pool.acquire("a").await.unwrap());
    drop(pool.acquire("c").await.unwrap());
    settle(&c, 1).await;
    assert_eq!(state_of(&pool, "a"), ModelState::Loaded);
    assert_eq!(state_of(&pool, "b"), ModelState::Unloaded);
    assert_eq!(state_of(&pool, "c"), ModelState::Loaded);
    assert_eq!(pool.used_bytes("cpu"), 80 << 20);
    // Every model again, alternating: each load stays within the budget.
    for name in ["b", "c", "a", "b", "a", "c"] {
        drop(pool.acquire(name).await.unwrap());
        assert!(pool.used_bytes("cpu") <= 100 << 20);
        assert_eq!(state_of(&pool, name), ModelState::Loaded);
    }
    assert_eq!(c.loads.load(Ordering::SeqCst), 3 + 4);
}

#[tokio::test]
async fn models_in_use_and_pinned_models_stay() {
    let c = Arc::new(Counts::default());
    let mut pinned = source("p", 40, &c);
    pinned.pinned = true;
    let pool = ModelPool::new(
        vec![pinned, source("a", 40, &c), source("b", 40, &c)],
        None,
        config(100),
    )
    .unwrap();
    drop(pool.acquire("p").await.unwrap());
    let held = pool.acquire("a").await.unwrap();
    // `b` needs room held by a pinned model and one in use: it waits, and
    // gets it once the request on `a` ends.
    let waiting = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.acquire("b").await.map(|l| l.name().to_string()) })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiting.is_finished());
    assert_eq!(state_of(&pool, "b"), ModelState::Unloaded);
    drop(held);
    assert_eq!(waiting.await.unwrap().unwrap(), "b");
    assert_eq!(state_of(&pool, "p"), ModelState::Loaded);
    assert_eq!(state_of(&pool, "a"), ModelState::Unloaded);
    // Held past the wait: a clear refusal naming who holds the room.
    let held = pool.acquire("b").await.unwrap();
    match pool.acquire("a").await {
        Err(PoolError::Timeout(m)) => {
            assert!(
                m.contains("no room") && m.contains("b (1 in flight)"),
                "{m}"
            )
        }
        Err(e) => panic!("expected a timeout, got {e}"),
        Ok(_) => panic!("expected a timeout, got the model"),
    }
    drop(held);
}

#[tokio::test]
async fn too_large_and_unknown_models_are_refused_at_once() {
    let c = Arc::new(Counts::default());
    let pool = ModelPool::new(
        vec![source("a", 40, &c), source("big", 400, &c)],
        None,
        config(100),
    )
    .unwrap();
    match pool.acquire("big").await {
        Err(PoolError::TooLarge {
            need_mib,
            budget_mib,
            ..
        }) => assert_eq!((need_mib, budget_mib), (400, 100)),
        _ => panic!("expected TooLarge"),
    }
    match pool.acquire("nope").await {
        Err(PoolError::NotFound { available, .. }) => assert_eq!(available, ["a", "big"]),
        _ => panic!("expected NotFound"),
    }
    // Ollama's `:latest` names the same model.
    assert_eq!(pool.acquire("a:latest").await.unwrap().name(), "a");
    assert_eq!(c.loads.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_failed_load_is_reported_then_tried_again() {
    let tries = Arc::new(AtomicUsize::new(0));
    let counts = Arc::new(Counts::default());
    let flaky = ModelSource {
        load: {
            let (tries, counts) = (tries.clone(), counts.clone());
            Arc::new(move || match tries.fetch_add(1, Ordering::SeqCst) {
                0 => Err("disk on fire".to_string()),
                _ => Ok(Fake {
                    counts: counts.clone(),
                }),
            })
        },
        ..source("f", 10, &counts)
    };
    let pool = ModelPool::new(vec![flaky], None, config(100)).unwrap();
    match pool.acquire("f").await {
        Err(PoolError::LoadFailed { message, .. }) => assert_eq!(message, "disk on fire"),
        _ => panic!("expected LoadFailed"),
    }
    assert_eq!(pool.list()[0].state, ModelState::Failed);
    // Within the pause: the same error, no new attempt.
    assert!(matches!(
        pool.acquire("f").await,
        Err(PoolError::LoadFailed { .. })
    ));
    assert_eq!(tries.load(Ordering::SeqCst), 1);
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(pool.acquire("f").await.is_ok());
    assert_eq!(tries.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn idle_models_are_unloaded_unless_pinned_or_in_use() {
    let c = Arc::new(Counts::default());
    let mut pinned = source("p", 10, &c);
    pinned.pinned = true;
    let mut cfg = config(100);
    cfg.idle_unload = Some(Duration::from_millis(50));
    let pool = ModelPool::new(
        vec![pinned, source("a", 10, &c), source("b", 10, &c)],
        None,
        cfg,
    )
    .unwrap();
    drop(pool.acquire("p").await.unwrap());
    drop(pool.acquire("a").await.unwrap());
    let held = pool.acquire("b").await.unwrap();
    assert_eq!(pool.unload_idle(), 0, "nothing idle long enough yet");
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(pool.unload_idle(), 1);
    settle(&c, 1).await;
    assert_eq!(state_of(&pool, "p"), ModelState::Loaded);
    assert_eq!(state_of(&pool, "a"), ModelState::Unloaded);
    assert_eq!(state_of(&pool, "b"), ModelState::Loaded);
    drop(held);
    // The background task takes `b` once it has been idle.
    let task = pool.spawn_idle_unloader();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(state_of(&pool, "b"), ModelState::Unloaded);
    assert_eq!(state_of(&pool, "p"), ModelState::Loaded);
    task.abort();
}

#[tokio::test]
async fn unload_on_request_waits_for_requests_in_flight() {
    let c = Arc::new(Counts::default());
    let pool = ModelPool::new(vec![source("a", 10, &c)], None, config(100)).unwrap();
    assert!(!pool.unload("a").await.unwrap(), "not loaded yet");
    let held = pool.acquire("a").await.unwrap();
    match pool.unload("a").await {
        Err(PoolError::InUse { in_flight, .. }) => assert_eq!(in_flight, 1),
        _ => panic!("expected InUse"),
    }
    let unloading = {
        let pool = pool.clone();
        tokio::spawn(async move { pool.unload("a").await })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    drop(held);
    assert!(unloading.await.unwrap().unwrap());
    assert_eq!(c.drops.load(Ordering::SeqCst), 1);
    assert_eq!(pool.list()[0].state, ModelState::Unloaded);
}

struct Shelf(Arc<Counts>);

impl Catalog<Fake> for Shelf {
    fn find(&self, name: &str) -> Option<Result<ModelSource<Fake>, String>> {
        match name {
            "shelf-model" => Some(Ok(source(name, 10, &self.0))),
            "shelf-broken" => Some(Err("shelf-broken has no weights".into())),
            _ => None,
        }
    }

    fn names(&self) -> Vec<String> {
        vec!["shelf-model".into(), "shelf-broken".into()]
    }
}

#[tokio::test]
async fn the_catalog_adds_models_by_name() {
    let c = Arc::new(Counts::default());
    let pool = ModelPool::new(
        vec![source("a", 10, &c)],
        Some(Box::new(Shelf(c.clone()))),
        config(100),
    )
    .unwrap();
    let names: Vec<String> = pool.list().into_iter().map(|s| s.name).collect();
    assert_eq!(
        names,
        ["a", "shelf-model"],
        "unservable entries are not listed"
    );
    assert_eq!(
        pool.acquire("shelf-model").await.unwrap().name(),
        "shelf-model"
    );
    assert_eq!(state_of(&pool, "shelf-model"), ModelState::Loaded);
    match pool.acquire("shelf-broken").await {
        Err(PoolError::Unservable(m)) => assert!(m.contains("no weights")),
        _ => panic!("expected Unservable"),
    }
    assert!(ModelPool::new(
        vec![source("a", 1, &c), source("a", 1, &c)],
        None,
        config(1)
    )
    .is_err());
}

#[tokio::test]
async fn keep_alive_overrides_the_idle_time() {
    let c = Arc::new(Counts::default());
    let mut pinned = source("p", 10, &c);
    pinned.pinned = true;
    let pool = ModelPool::new(
        vec![pinned, source("a", 10, &c), source("b", 10, &c)],
        None,
        config(100),
    )
    .unwrap();
    for n in ["p", "a", "b"] {
        drop(pool.acquire(n).await.unwrap());
    }
    // No idle time: nothing goes by itself.
    assert_eq!(pool.unload_idle(), 0);
    assert_eq!(pool.unloads_in("a"), None);
    // `keep_alive: 0` on `a`: unloaded once idle; a long one on `b` and
    // any on the pinned model keep them.
    pool.keep_alive("a", Some(Duration::ZERO)).unwrap();
    pool.keep_alive("b", Some(Duration::from_secs(600)))
        .unwrap();
    pool.keep_alive("p", Some(Duration::ZERO)).unwrap();
    let held = pool.acquire("a").await.unwrap();
    assert_eq!(pool.unload_idle(), 0, "in use");
    drop(held);
    assert_eq!(pool.unload_idle(), 1);
    assert_eq!(state_of(&pool, "a"), ModelState::Unloaded);
    assert_eq!(state_of(&pool, "p"), ModelState::Loaded);
    let left = pool.unloads_in("b").unwrap();
    assert!(
        left > Duration::from_secs(590) && left <= Duration::from_secs(600),
        "{left:?}"
    );
    // Forever.
    pool.keep_alive("b", None).unwrap();
    assert_eq!(pool.unloads_in("b"), None);
    assert!(pool.keep_alive("nope", None).is_err());
}
