"""The suffix tree equals a brute-force scan of every earlier occurrence: counts, the draft it follows,
the match it picks; built token by token, with sequences removed again (the global cache's eviction)."""

import random

import pytest

from eyas.spec_decode.suffix_tree import SuffixTree, best_draft


# -- brute force: scan every occurrence ------------------------------------------------------------------
def occurrences(seqs: list[list[int]], w: list[int], depth: int) -> list[tuple[int, int]]:
    """(sequence index, start) of each occurrence of ``w`` that fits in ``depth`` tokens."""
    m = len(w)
    if m > depth:
        return []
    return [(s, i) for s, seq in enumerate(seqs) for i in range(len(seq) - m + 1) if seq[i:i + m] == w]


def ref_follow(seqs, w, depth, max_tokens, min_prob):
    """Grow w by the most frequent next token (the latest occurrence on a tie) while the path probability
    (product of count(w + t) / count(w)) stays >= min_prob."""
    tokens, probs, score, prob, w = [], [], 0.0, 1.0, list(w)
    while len(tokens) < max_tokens:
        base = len(occurrences(seqs, w, depth))
        following: dict[int, list] = {}  # next token -> [count, latest occurrence]
        for s, i in occurrences(seqs, w, depth):
            if i + len(w) < len(seqs[s]) and len(w) < depth:
                entry = following.setdefault(seqs[s][i + len(w)], [0, (-1, -1)])
                entry[0] += 1
                entry[1] = max(entry[1], (s, i))
        if not following:
            break
        token = max(following, key=lambda t: following[t])
        if prob * following[token][0] / base < min_prob:
            break
        prob *= following[token][0] / base
        tokens.append(token)
        probs.append(prob)
        score += prob
        w.append(token)
    return tokens, probs, score


def ref_best(seqs, context, depth, max_tokens, factor, min_prob):
    """Every match length m < min(len(context), depth) from 1 up while the suffix occurs; the best score
    wins, the later (longer) one on a tie. Returns (tokens, probs, score, m) or None."""
    best = None
    for m in range(1, min(len(context), depth)):
        w = context[len(context) - m:]
        if not occurrences(seqs, w, depth):
            break
        tokens, probs, score = ref_follow(seqs, w, depth, min(max_tokens, int(m * factor + 1e-6)), min_prob)
        if best is None or score >= best[2]:
            best = (tokens, probs, score, m)
    return best if best is not None and best[2] > 0 else None


# -- checks of the tree itself -------------------------------------------------------------------------------
def check_tree(tree: SuffixTree, seqs: list[list[int]]) -> None:
    """Structure (labels, parents, no mergeable node, node count) and every vertex's count vs the brute force."""
    assert tree.root.count == sum(map(len, seqs))
    stack, seen = [(tree.root, [])], 0
    while stack:
        node, prefix = stack.pop()
        seen += 1
        if node is not tree.root:
            assert node.tokens and node.count > 0
            for j in range(1, len(node.tokens) + 1):  # every vertex of the run has the node's count
                assert len(occurrences(seqs, prefix + node.tokens[:j], tree.max_depth)) == node.count
            assert not (len(node.children) == 1 and next(iter(node.children.values())).count == node.count)
        assert sum(c.count for c in node.children.values()) <= node.count
        for token, child in node.children.items():
            assert child.tokens[0] == token and child.parent is node
            stack.append((child, prefix + node.tokens))
    assert seen == tree.num_nodes


def random_seqs(rng: random.Random, n: int) -> list[list[int]]:
    vocab = rng.randint(2, 5)
    return [[rng.randrange(vocab) for _ in range(rng.randint(0, 40))] for _ in range(n)]


def test_docstring_example():
    tree = SuffixTree(3)
    writer = tree.writer()
    a, b, c = 0, 1, 2
    writer.extend([a, b, a, b, c])
    check_tree(tree, [[a, b, a, b, c]])
    assert tree.matches([9, a, b])[1][0].count == 2  # count(ab) = 2
    draft = best_draft(tree.matches([9, a, b]), 3, 8, 1.0, 0.1)  # from "ab": a or c, 1/2 each; c is newer
    assert (draft.tokens, draft.probs, draft.match_len) == ([c], [0.5], 2)


def test_counts_and_drafts_equal_brute_force_on_random_streams():
    rng = random.Random(0)
    drafted = 0
    for _ in range(300):
        depth = rng.randint(1, 8)
        (seq,) = random_seqs(rng, 1)
        tree = SuffixTree(depth)
        writer = tree.writer()
        pos = 0
        while pos < len(seq):  # appended in steps of 1-4 tokens, as the engine emits them
            step = rng.randint(1, 4)
            writer.extend(seq[pos:pos + step])
            pos += step
            done = seq[:pos]
            context = done[-depth:]
            assert writer.matches() == tree.matches(context)  # path ends = a walk from the root
            for m, (node, _) in enumerate(writer.matches(), 1):
                assert node.count == len(occurrences([done], context[-m:], depth))
            max_tokens, factor, min_prob = rng.randint(1, 8), rng.choice([0.5, 1.0, 2.0, 4.0]), rng.choice([0, 0.1, 0.4])
            expected = ref_best([done], context, depth, max_tokens, factor, min_prob)
            got = best_draft(writer.matches(), depth, max_tokens, factor, min_prob)
            if expected is None:
                assert got is None
            else:
                assert (got.tokens, got.probs, got.match_len) == expected[:2] + (expected[3],)
                assert got.score == pytest.approx(expected[2])
                drafted += 1
        check_tree(tree, [seq])
    assert drafted > 1000  # most steps exercise a real draft, not the empty path


def test_many_sequences_with_fifo_removal_equal_brute_force():
    rng = random.Random(1)
    for _ in range(60):
        depth = rng.randint(1, 8)
        tree = SuffixTree(depth)
        cached: list[list[int]] = []
        for seq in random_seqs(rng, 12):
            tree.writer().extend(seq)
            cached.append(seq)
            if len(cached) > 4:  # oldest first, as the global cache evicts
                tree.remove(cached.pop(0))
            check_tree(tree, cached)
            fresh = SuffixTree(depth)
            for s in cached:
                fresh.writer().extend(s)
            assert tree.num_nodes == fresh.num_nodes  # compressed form is canonical: nothing left behind
            for _ in range(5):
                context = random_seqs(rng, 1)[0][:depth] or [0]
                for m, (node, _) in enumerate(tree.matches(context), 1):
                    assert node.count == len(occurrences(cached, context[-m:], depth))
                args = (rng.randint(1, 8), rng.choice([0.5, 1.0, 3.0]), rng.choice([0, 0.1, 0.3]))
                expected = ref_best(cached, context, depth, *args)
                got = best_draft(tree.matches(context), depth, *args)
                assert (got and (got.tokens, got.probs, got.match_len)) == (
                    expected and (expected[0], expected[1], expected[3]))
        for seq in list(cached):
            tree.remove(seq)
        assert tree.root.count == 0 and not tree.root.children and tree.num_nodes == 1


def test_best_draft_beats_only_a_higher_score():
    tree = SuffixTree(8)
    tree.writer().extend([1, 2, 3, 4, 5, 1, 2, 3])
    matches = tree.matches([7, 1, 2, 3])
    draft = best_draft(matches, 8, 8, 1.0, 0.1)
    assert draft.tokens == [4, 5, 1] and draft.match_len == 3  # limited to 3 tokens by factor 1 x match 3
    assert best_draft(matches, 8, 8, 1.0, 0.1, beat=draft.score) is None
    assert best_draft(matches, 8, 8, 1.0, 0.1, beat=draft.score - 0.01).tokens == draft.tokens
