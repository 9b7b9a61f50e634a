//! The model a generation runs: a copy of the compiled model's module tree sharing its weights (cheap: the
//! parameters are handles), whose attention slots the generation may refill. A model sharded at
//! `ShardLevel::Parameters` keeps 1/W of each weight per rank and gathers a block's weights every time it
//! runs; a generation would gather them again for every token, so the copy gathers every sharded weight
//! once, at the start (collective over the world, in model order), and holds the whole weights for the
//! generation's life: this rank's slices plus one whole model in the compute dtype (over thread ranks, one
//! whole model per process: the gathered tensors are shared).

use autosp_core::module::visit_mut;
use autosp_core::nn::RmsNorm;
use autosp_core::{Param, ShardLevel};
use autosp_models::LlamaModel;

/// The whole parameter: `p` itself, or a new parameter holding its gathered tensor when it is sharded at
/// `Parameters` (collective). Adds the gathered bytes to `gathered`.
fn whole(p: &Param, gathered: &mut usize) -> autosp_core::Result<Param> {
    match p.shard() {
        Some(s) if s.level == ShardLevel::Parameters => {
            let t = p.whole()?;
            *gathered += t.elem_count() * t.dtype().size_in_bytes();
            let q = Param::new(p.name(), t);
            q.set_frozen(p.is_frozen());
            Ok(q)
        }
        _ => Ok(p.clone()),
    }
}

fn norm(n: &mut RmsNorm, gathered: &mut usize) -> autosp_core::Result<()> {
    n.weight = whole(&n.weight, gathered)?;
    Ok(())
}

/// A copy of `model` for generation, and the bytes of weights it gathered (0 unless some were sharded at
/// `Parameters`). Collective over the world when they were.
pub(crate) fn inference_copy(model: &LlamaModel) -> autosp_core::Result<(LlamaModel, usize)> {
    let mut copy = model.clone();
    let sharded = copy.params().iter().any(|p| p.shard().is_some_and(|s| s.level == ShardLevel::Parameters));
    if !sharded {
        return Ok((copy, 0));
    }
    let mut gathered = 0;
    copy.embed_tokens.table = whole(&copy.embed_tokens.table, &mut gathered)?;
    for layer in &mut copy.layers.0 {
        norm(&mut layer.input_layernorm, &mut gathered)?;
        norm(&mut layer.post_attention_layernorm, &mut gathered)?;
        if let Some((pre, post)) = &mut layer.feedforward_norms {
            norm(pre, &mut gathered)?;
            norm(post, &mut gathered)?;
        }
        if let (Some(qn), Some(kn)) = (&mut layer.self_attn.q_norm, &mut layer.self_attn.k_norm) {
            norm(qn, &mut gathered)?;
            norm(kn, &mut gathered)?;
        }
    }
    norm(&mut copy.norm, &mut gathered)?;
    // Every linear layer (projections, MLP, LM head) with its bias and LoRA adapter, in model order.
    let mut failed = None;
    visit_mut(&mut copy, "", &mut |_, m| {
        let Some(l) = m.as_linear_mut() else { return };
        if failed.is_some() {
            return;
        }
        let mut swap = || -> autosp_core::Result<()> {
            l.weight = whole(&l.weight, &mut gathered)?;
            l.bias = l.bias.as_ref().map(|b| whole(b, &mut gathered)).transpose()?;
            if let Some(a) = &mut l.lora {
                a.a = whole(&a.a, &mut gathered)?;
                a.b = whole(&a.b, &mut gathered)?;
            }
            Ok(())
        };
        failed = swap().err();
    });
    if let Some(e) = failed {
        return Err(e);
    }
    if let Some(p) = copy.params().iter().find(|p| p.shard().is_some_and(|s| s.level == ShardLevel::Parameters)) {
        return Err(autosp_core::Error::InvalidArgument {
            op: "inference_copy",
            msg: format!("parameter `{}` is still sharded after gathering the model's weights", p.name()),
        });
    }
    Ok((copy, gathered))
}
