"""Sampling and the lossless acceptance rules: tensors in, tensors out (the logits
processed by stages/logits.py, the uniforms keyed by stages/rng.py).

No shared random generator: every uniform is a hash of (request seed, absolute token position,
purpose salt), so a request draws the same numbers whatever else is in the batch. The token
emitted at position P always comes from `sample(p, seed, P, SALT_SAMPLE)`; with point-mass
drafts (argmax, n-gram, a greedy or dynamic tree's children) the acceptance rule is realised
through that very sample, so speculation then emits the same tokens as plain decoding with the
same seed. Drafts drawn from the drafter's q (sampled chains and fixed trees) keep p's law but
not those very tokens: the rejection rule, used for requests without a seed.

Requests with a seed draw by a coupling instead (`couple`): the token emitted at position P is
argmax_v log p(v) + G(seed, P, v), Gumbel noise keyed by the token id too (the Gumbel-max
trick: a draw of p), so it depends on nothing but p, the seed and the position. The sampler
makes each such row of p a point mass at that token before any acceptance rule, and every rule
then accepts exactly the drafts equal to it and emits it: speculation, whatever k, tree or
batch, emits plain decoding's tokens. Drafters propose argmax_v log q(v) + G with the same
noise, which the target then accepts with probability at least (1 - TV) / (1 + TV).

A token's position is the index it takes in the request's sequence (prompt + output), so the
first output token of a prompt of length L has position L.
"""

from __future__ import annotations

import torch

from models import native
from stages.rng import SALT_ACCEPT, SALT_CHILD_ACCEPT, SALT_SAMPLE, uniform, uniforms


def sample(
    probs: torch.Tensor,  # [B, V], need not sum to 1
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, absolute position of the token drawn
    salt: int = SALT_SAMPLE,
    greedy: bool = False,
) -> torch.Tensor:
    """[B] int64: one draw per row by inverse CDF, the first index whose cdf exceeds u * total.

    Only tokens with positive probability can come out: u * total is kept below the total, and
    if cumsum's rounding still lands on a zero-probability token the row takes its argmax.
    `greedy` says every row has a single positive entry (an all-greedy batch): the draw is then
    that entry, found without the uniforms and the cumsum."""
    if greedy:
        return native.argmax(probs)
    return draw(probs, uniform(seeds, positions, salt))


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`sample` with its uniforms u [B] drawn already (a caller drawing a step's at once)."""
    vocab = probs.shape[-1]
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = u.to(cdf.dtype)[:, None]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=vocab - 1)
    drawn = probs.gather(1, tokens[:, None]).squeeze(1) > 0
    return torch.where(drawn, tokens, native.argmax(probs))


def chain_verify(
    target_probs: torch.Tensor,  # [B, k+1, V] processed target distributions
    draft_tokens: torch.Tensor,  # [B, k] int64
    draft_probs: torch.Tensor | None,  # [B, k, V] processed q; None: point-mass drafts
    num_drafts: torch.Tensor,  # [B] int64, k_r <= k; draft positions past k_r are ignored
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, absolute position of the first token emitted
    greedy: bool = False,  # every row of target_probs is one-hot (see `sample`)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain acceptance rule. Returns (tokens [B, k+1] int64, -1 padded; num_accepted [B]).

    Row r emits num_accepted + 1 tokens: the accepted drafts, then the recovered token (first
    rejection) or the bonus token (all k_r accepted, drawn from p at position k_r).

    Sampled drafts: accept x with probability min(1, p(x)/q(x)), recover from
    norm(max(0, p - q)). Point-mass drafts: accept x with probability p(x), else emit a draw
    of p with p(x) set to 0; realised by drawing t from p and accepting x iff t == x (t is
    then the emitted token), which has exactly that law. Greedy rows (one-hot p) accept
    while x is the argmax, under either rule.
    """
    batch, width, vocab = target_probs.shape
    k = width - 1
    steps = torch.arange(width, device=target_probs.device)
    if draft_probs is None or k == 0:
        flat = target_probs.reshape(-1, vocab)
        if greedy:
            drawn = native.argmax(flat).view(batch, width)
        else:
            u = uniform(seeds, positions[:, None] + steps, SALT_SAMPLE)  # [B, W]
            drawn = draw(flat, u.flatten()).view(batch, width)
        return point_mass_verify(drawn, draft_tokens, num_drafts)

    in_draft = steps[:k] < num_drafts[:, None]  # [B, k]
    drafts = draft_tokens.clamp(min=0)

    p_x = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [B, k]
    q_x = draft_probs.gather(2, drafts[..., None]).squeeze(2)  # [B, k]
    # the accept tests' uniforms and those of the token emitted at each position, at once
    u, u_emit = uniforms(seeds, positions[:, None] + steps, (SALT_ACCEPT, SALT_SAMPLE))
    num_accepted = _run_length((u[:, :k] * q_x < p_x) & in_draft)  # u < p/q, never if p(x) = 0

    rows = torch.arange(batch, device=target_probs.device)
    p = target_probs[rows, num_accepted]  # [B, V]
    rejected = (num_accepted < num_drafts)[:, None]
    q = draft_probs[rows, num_accepted.clamp(max=k - 1)] * rejected
    residual = (p - q).clamp(min=0)
    # p == q leaves no residual; a rejection then has probability 0 up to rounding
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    if greedy:
        last = native.argmax(residual)
    else:
        last = draw(residual, u_emit.gather(1, num_accepted[:, None]).squeeze(1))
    tokens = torch.cat([drafts, last[:, None]], 1)
    tokens = torch.where(steps < num_accepted[:, None], tokens, -1)
    return tokens.scatter(1, num_accepted[:, None], last[:, None]), num_accepted


def point_mass_verify(
    drawn: torch.Tensor,  # [B, k+1] int64, the target's token drawn at each position
    draft_tokens: torch.Tensor,  # [B, k] int64
    num_drafts: torch.Tensor,  # [B] int64, k_r <= k
) -> tuple[torch.Tensor, torch.Tensor]:
    """chain_verify's rule for point-mass drafts, given the target's draws: accept draft x
    while it equals the token drawn at its position; the first draw that differs (or the one
    after the last draft) is emitted. (tokens [B, k+1] -1 padded, num_accepted [B])."""
    k = draft_tokens.shape[1]
    steps = torch.arange(k + 1, device=drawn.device)
    in_draft = steps[:k] < num_drafts[:, None]  # [B, k]
    num_accepted = _run_length((drawn[:, :k] == draft_tokens.clamp(min=0)) & in_draft)
    return torch.where(steps <= num_accepted[:, None], drawn, -1), num_accepted


def _run_length(accepted: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] int64: how many leading positions are True."""
    return accepted.long().cumprod(1).sum(1)


def tree_verify(
    target_probs: torch.Tensor,  # [B, N+1, V]: row 0 the root (last token), row i+1 node i
    node_tokens: torch.Tensor,  # [B, N] int64 (-1: padding, never accepted)
    parents: torch.Tensor,  # [B, N] int64, parent node index, -1: child of the root
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, absolute position of the first token emitted
    depth: int | None = None,  # a bound on the tree's depth, known to the caller (no sync)
    greedy: bool = False,  # every row of target_probs is one-hot (see `sample`)
    node_depths: torch.Tensor | None = None,  # [B, N] from 1, when the caller knows them
    draft_probs: torch.Tensor | None = None,  # [B, N, V] the q each node was drawn from
    siblings: int = 0,  # with draft_probs: a bound on any node's children
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree acceptance rule. Returns (tokens [B, depth+1] int64 -1 padded, num_accepted
    [B], path [B, depth] accepted node indices -1 padded), depth being the tree's or the bound
    given.

    Children as point masses (draft_probs None, or greedy): from the root, the children of the
    current node are tried in index order, child c accepted with probability p(c), p(c) := 0
    and renormalised after each rejection; if none is accepted a draw of the remaining p is
    emitted. Drawing t from p and accepting the first child whose token is t has exactly that
    law, and emits what plain decoding with the same seed would. The draw at a node depends
    only on its row and its depth (the uniform of the position it emits at), so every row
    draws at once and the walk then only compares tokens.

    Children drawn independently from the drafter's q: `_sampled_tree_walk`.
    """
    if node_depths is None:
        node_depths = _node_depths(parents)
    if depth is None:
        depth = int(node_depths.max()) if node_depths.numel() else 0
    if draft_probs is not None and not greedy:
        return _sampled_tree_walk(
            target_probs, node_tokens, parents, draft_probs, seeds, positions, depth, siblings
        )
    if greedy:
        drawn = target_probs.argmax(-1)  # [B, N+1]
    else:
        batch, rows, vocab = target_probs.shape
        levels = torch.arange(depth + 1, device=positions.device)
        u = uniform(seeds, positions[:, None] + levels, SALT_SAMPLE)  # [B, depth + 1]
        row_levels = torch.cat([torch.zeros_like(node_depths[:, :1]), node_depths], 1)
        u_rows = u.gather(1, row_levels)
        drawn = draw(target_probs.reshape(-1, vocab), u_rows.flatten()).view(batch, rows)
    return _walk_tree(drawn, node_tokens, parents, depth)


def _sampled_tree_walk(
    target_probs: torch.Tensor,  # [B, N+1, V]
    node_tokens: torch.Tensor,  # [B, N]
    parents: torch.Tensor,  # [B, N]
    draft_probs: torch.Tensor,  # [B, N, V] q of each node (its siblings share it)
    seeds: torch.Tensor,
    positions: torch.Tensor,
    depth: int,
    siblings: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_verify for children drawn independently from q (SpecInfer's multi-draft rule): at
    the current node its children are tested in index order, child x accepted with probability
    min(1, p(x) / q(x)) and p := norm(max(0, p - q)) after each rejection; if none is accepted
    a draw of the remaining p is emitted. Each level's emitted token then follows p whatever
    q is, as with one sampled draft (the chain's rule is this with one child a node)."""
    batch, _, vocab = target_probs.shape
    siblings = max(siblings, 1)
    rows = torch.arange(batch, device=positions.device)
    nodes = torch.arange(node_tokens.shape[1], device=positions.device)
    levels = torch.arange(depth, device=positions.device)
    salts = tuple(SALT_CHILD_ACCEPT + r for r in range(siblings))
    u = uniforms(seeds, positions[:, None] + levels, salts).permute(1, 2, 0)  # [B, D, S]
    current = torch.full_like(positions, -1)  # node index, -1: the root
    walking = torch.ones_like(positions, dtype=torch.bool)
    steps, kept, remaining = [], [], []
    for level in range(depth):  # the nodes at `depth` have no children: nothing to test
        p = target_probs[rows, current + 1]  # [B, V]
        child = (parents == current[:, None]) & (node_tokens >= 0)  # [B, N]
        order = torch.where(child, nodes, nodes + nodes.numel()).argsort(1)[:, :siblings]
        valid = child.gather(1, order)  # [B, S] the children, in index order, then padding
        x = node_tokens.gather(1, order).clamp(min=0)  # [B, S]
        q = draft_probs[rows, order[:, 0]]  # [B, V]
        residuals = [p]  # p after 0, 1, .. rejections
        for _ in range(siblings):
            left = (residuals[-1] - q).clamp(min=0)
            total = left.sum(-1, keepdim=True)
            # p == q leaves no residual; a rejection then has probability 0 up to rounding
            residuals.append(torch.where(total > 0, left / total, residuals[-1]))
        stacked = torch.stack(residuals, 1)  # [B, S + 1, V]
        p_x = stacked[:, :siblings].gather(2, x[..., None]).squeeze(2)  # [B, S]
        passed = valid & (u[:, level] * q.gather(1, x) < p_x)  # never if p(x) = 0
        first = passed.int().argmax(1)  # the first child that passes
        accepted = walking & passed.any(1)
        remaining.append(stacked[rows, valid.sum(1)])  # what a stop here draws from
        node = order[rows, first]
        steps.append(torch.where(accepted, node, -1))
        kept.append(torch.where(accepted, x[rows, first], -1))
        current = torch.where(accepted, node, current)
        walking = accepted
    remaining.append(target_probs[rows, current + 1])  # a walk through every level
    path = torch.stack(steps, 1) if depth else parents[:, :0]  # [B, depth]
    num_accepted = (path >= 0).sum(1)
    stop = torch.stack(remaining, 1)[rows, num_accepted]  # [B, V]
    last = draw(stop, uniform(seeds, positions + num_accepted, SALT_SAMPLE))
    # [B, depth + 1]: the accepted tokens, -1 from the stop on
    tokens = torch.stack([*kept, torch.full_like(positions, -1)], 1)
    return tokens.scatter(1, num_accepted[:, None], last[:, None]), num_accepted, path


def _walk_tree(
    drawn: torch.Tensor,  # [B, N+1] the token each verify row draws
    node_tokens: torch.Tensor,  # [B, N]
    parents: torch.Tensor,  # [B, N]
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_verify once every row has drawn: a node matches when its token is its parent's
    draw, and once a level finds no matching child of the current node no later level does."""
    matches = node_tokens == drawn.gather(1, parents + 1)  # [B, N]
    current = torch.full_like(parents[:, 0], -1)  # node index, -1: the root
    steps = []
    for _ in range(depth):
        hit = (parents == current[:, None]) & matches
        found = hit.any(1)
        current = torch.where(found, hit.int().argmax(1), current)  # the first hit
        steps.append(torch.where(found, current, -1))
    path = torch.stack(steps, 1) if steps else parents[:, :0]  # [B, depth]
    accepted = (path >= 0).sum(1)
    rows = torch.cat([torch.zeros_like(path[:, :1]), path + 1], 1)  # root, path (-1 -> root)
    tokens = drawn.gather(1, rows)
    positions = torch.arange(depth + 1, device=path.device)
    return torch.where(positions <= accepted[:, None], tokens, -1), accepted, path


def _node_depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] each node's depth (children of the root have depth 1)."""
    depths = torch.ones_like(parents)
    for _ in range(parents.shape[1]):  # a forest of n nodes settles after n rounds
        above = depths.gather(1, parents.clamp(min=0))
        depths = torch.where(parents >= 0, above + 1, 1)
    return depths


def logprobs(
    logits: torch.Tensor,  # [B, V] raw model logits
    tokens: torch.Tensor,  # [B] int64, the tokens emitted
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under the raw model distribution (log_softmax of the unprocessed
    logits: no penalties, temperature or truncation), as OpenAI reports them.

    Returns (chosen [B] float32, top_ids [B, n] int64, top_logprobs [B, n] float32), best
    first."""
    log_probs = torch.log_softmax(logits.float(), -1)
    chosen = log_probs.gather(1, tokens[:, None]).squeeze(1)
    top_logprobs, top_ids = log_probs.topk(n, dim=-1)
    return chosen, top_ids, top_logprobs
