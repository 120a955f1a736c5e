"""Statistics shared by the sampler and rejection-sampler tests."""

import numpy as np
import torch
from scipy import stats


def chi2_pvalue(tokens: torch.Tensor, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of sampled token ids to probs; zero-prob tokens must not occur."""
    counts = np.bincount(tokens.cpu().numpy(), minlength=len(probs)).astype(np.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled tokens outside support: {counts[~support]}"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)
