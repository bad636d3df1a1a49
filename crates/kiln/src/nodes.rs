//! A tensor-parallel model over several nodes (processes, on one host or
//! many): `--nnodes N --node-rank K --master-addr A --master-port P`, as
//! torchrun and vLLM spell it. Every node runs `--tensor-parallel T / N`
//! ranks (ranks `K·T/N ..`); node 0 serves HTTP and leads — each cache it
//! makes and each step it runs goes to the others first
//! (`kiln_models::tp::Followers`), which run the same step on their ranks
//! (`kiln_models::tp::follow`) — and the collectives join every node's
//! ranks: NCCL, whose unique id node 0 makes and sends the others, or on
//! the CPU a hub on node 0 (`P + 1`) relaying host buffers.
//!
//! Rendezvous: node 0 listens on `A:P`; each other node connects, says
//! its rank, and (GPUs) reads the NCCL id.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use kiln_tensor::Backend;

use crate::cli::TpTransport;

/// Where this process stands among the nodes of a tensor-parallel model.
#[derive(Args, Debug, Clone)]
pub struct NodeArgs {
    /// Nodes (processes) the --tensor-parallel ranks span, each with an
    /// equal share; node 0 serves.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub nnodes: u32,
    /// This node's index (0: the one that serves HTTP; the others follow
    /// its steps and serve nothing).
    #[arg(long, default_value_t = 0)]
    pub node_rank: u32,
    /// Node 0's address, where the others meet it.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Node 0's port for the meeting (the CPU's collectives use the next).
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
}

impl Default for NodeArgs {
    fn default() -> Self {
        NodeArgs {
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
        }
    }
}

/// This node's ranks, and its part in the group.
pub struct Joined {
    pub backends: Vec<Arc<dyn Backend>>,
    pub role: Role,
}

pub enum Role {
    /// Node 0: the connections to the others.
    Leader(Arc<kiln_models::tp::Followers>),
    /// Another node: its connection to node 0.
    Follower(TcpStream),
}

fn addr(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .with_context(|| format!("resolving {host}:{port}"))?
        .next()
        .with_context(|| format!("{host}:{port} resolves to nothing"))
}

/// Meets the other nodes and makes this node's ranks' backends on
/// `device` (`cpu`, or GPUs from `cuda:K` on).
pub fn join(n: &NodeArgs, device: &str, tp: usize, transport: TpTransport) -> Result<Joined> {
    let nodes = n.nnodes as usize;
    let me = n.node_rank as usize;
    anyhow::ensure!(me < nodes, "--node-rank {me} of --nnodes {nodes}");
    anyhow::ensure!(
        tp % nodes == 0,
        "--tensor-parallel {tp} does not split over --nnodes {nodes}"
    );
    let local = tp / nodes;
    let first = me * local;
    let control = addr(&n.master_addr, n.master_port)?;
    let hub = addr(&n.master_addr, n.master_port.wrapping_add(1))?;
    let on_cpu = crate::cli::tensor_parallel_on_cpu(device)?;
    let (role, nccl_id) = if me == 0 {
        let listener = TcpListener::bind(control)
            .with_context(|| format!("listening for the other nodes on {control}"))?;
        if on_cpu {
            let h = TcpListener::bind(hub).with_context(|| format!("listening on {hub}"))?;
            std::thread::spawn(move || kiln_tensor::collective::serve_hub(h, tp));
        }
        let id = match on_cpu {
            true => None,
            false => Some(kiln_cuda::nccl_unique_id()?),
        };
        let mut others: Vec<Option<TcpStream>> = (1..nodes).map(|_| None).collect();
        eprintln!("kiln: waiting for {} more node(s) on {control}", nodes - 1);
        while others.iter().any(Option::is_none) {
            let (mut s, from) = listener.accept()?;
            let mut k = [0u8; 4];
            s.read_exact(&mut k)?;
            let k = u32::from_le_bytes(k) as usize;
            if k == 0 || k >= nodes || others[k - 1].is_some() {
                eprintln!("kiln: ignoring a node {k} from {from}");
                continue;
            }
            if let Some(id) = id {
                s.write_all(&id)?;
            }
            s.set_nodelay(true)?;
            others[k - 1] = Some(s);
        }
        let f = kiln_models::tp::Followers::new(others.into_iter().flatten().collect());
        (Role::Leader(f), id)
    } else {
        let mut s = kiln_tensor::collective::connect_retrying(control)
            .with_context(|| format!("meeting node 0 at {control}"))?;
        s.write_all(&(me as u32).to_le_bytes())?;
        let id = match on_cpu {
            true => None,
            false => {
                let mut id = [0u8; 128];
                s.read_exact(&mut id)?;
                Some(id)
            }
        };
        s.set_nodelay(true)?;
        (Role::Follower(s), id)
    };
    let backends: Vec<Arc<dyn Backend>> = match nccl_id {
        None => {
            let group = kiln_tensor::HostGroup::tcp(tp, first..first + local, hub)
                .with_context(|| format!("joining the collectives at {hub}"))?;
            let threads = (rayon::current_num_threads() / local).max(1);
            (first..first + local)
                .map(|r| -> Result<Arc<dyn Backend>> {
                    Ok(Arc::new(crate::cli::cpu_backend().in_group(
                        group.clone(),
                        r,
                        threads,
                    )?))
                })
                .collect::<Result<_>>()?
        }
        Some(id) => {
            anyhow::ensure!(
                transport == TpTransport::Nccl,
                "--tp-transport host runs on one node"
            );
            let gpu0 = crate::cli::first_gpu(device)?;
            let ordinals: Vec<usize> = (gpu0..gpu0 + local).collect();
            kiln_cuda::nccl_ranks_joining(&ordinals, tp, first, id)?
                .into_iter()
                .zip(&ordinals)
                .map(|(r, &o)| -> Result<Arc<dyn Backend>> {
                    Ok(Arc::new(
                        crate::cli::cuda_backend(o)?.in_group(kiln_cuda::CudaGroup::Nccl(r)),
                    ))
                })
                .collect::<Result<_>>()?
        }
    };
    Ok(Joined { backends, role })
}

/// A node past the first: load this node's ranks, then run node 0's
/// steps until it goes away.
pub fn follow(model: &crate::cli::ModelArgs) -> Result<()> {
    let path = model.path()?;
    let joined = join(
        &model.nodes,
        &model.device,
        model.tensor_parallel as usize,
        model.tp_transport,
    )?;
    let Role::Follower(mut leader) = joined.role else {
        anyhow::bail!("node 0 serves; it does not follow");
    };
    let loaded = kiln_engine::LoadedModel::load_nodes(
        &path,
        joined.backends,
        None,
        model.expert_parallel,
        None,
        model.quantize,
    )
    .with_context(|| format!("loading {}", path.display()))?;
    eprintln!(
        "kiln: node {} of {} holds ranks of {} and follows node 0",
        model.nodes.node_rank,
        model.nodes.nnodes,
        path.display()
    );
    kiln_models::tp::follow(loaded.model.as_ref(), &mut leader)?;
    eprintln!("kiln: node 0 is gone; this node stops");
    Ok(())
}
