"""The Engram rows a fine-tuning run trains (`train --lora --train-engram`): sparse, touched rows only.

A released table has billions of parameters (197B over all of them); a dense fp32 copy, or Adam state for every row,
fits no single machine. A `TrainedRows` beside a frozen table (`DeviceTable.trained`) holds an fp32 master value
and lazy Adam state (first and second moments, its own step count) for each row some training batch has looked
up, and nothing for the rest. A lookup under autograd reads every row it needs from here, adding rows it has not
seen with their stored values; gradients reach only those rows, and `adam_step` moves only the rows of the last
step (the "lazy" Adam of sparse embeddings: a row's moments advance when it is used). Lookups without gradients
(evaluation) read trained rows and leave the others as stored.
"""

from __future__ import annotations

import torch


class TrainedRows:
    def __init__(self, dim: int, device: torch.device) -> None:
        self.rows = torch.empty(0, dtype=torch.long, device=device)  # the table row of each slot
        self.values = torch.empty(0, dim, device=device, requires_grad=True)  # fp32 master values [slots, dim]
        self.exp_avg = torch.empty(0, dim, device=device)
        self.exp_avg_sq = torch.empty(0, dim, device=device)
        self.steps = torch.empty(0, dtype=torch.long, device=device)  # Adam steps each row has taken
        self.used = torch.empty(0, dtype=torch.long, device=device)  # slots the current step looked up

    def __len__(self) -> int:
        return int(self.rows.numel())

    def _find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where the row has none."""
        if not len(self):
            return torch.full_like(ids, -1)
        order = torch.argsort(self.rows)
        ordered = self.rows[order]
        pos = torch.searchsorted(ordered, ids).clamp(max=len(self) - 1)
        return torch.where(ordered[pos] == ids, order[pos], -1)

    def overlay(self, ids: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """Rows for flat `ids` given their stored values `stored` [n, dim]: under autograd all from the trained
        values (unseen rows added, starting at their stored value); otherwise the trained ones replace theirs."""
        if not torch.is_grad_enabled():
            slots = self._find(ids)
            found = slots >= 0
            out = stored.clone()
            out[found] = self.values.detach()[slots[found]]
            return out
        unique, inverse = torch.unique(ids, return_inverse=True)
        slots = self._find(unique)
        new = slots < 0
        if bool(new.any()):
            first = torch.full((unique.numel(),), ids.numel(), dtype=torch.long, device=ids.device)
            first.scatter_reduce_(0, inverse, torch.arange(ids.numel(), device=ids.device), "amin")
            self._grow(unique[new], stored[first[new]].detach().float())
            slots = self._find(unique)
        self.used = torch.unique(torch.cat((self.used, slots)))
        return self.values[slots[inverse]]

    def _grow(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        zeros = torch.zeros_like(values)
        self.rows = torch.cat((self.rows, rows))
        self.values = torch.cat((self.values.detach(), values)).requires_grad_()
        self.exp_avg, self.exp_avg_sq = torch.cat((self.exp_avg, zeros)), torch.cat((self.exp_avg_sq, zeros))
        self.steps = torch.cat((self.steps, torch.zeros_like(rows)))

    @torch.no_grad()
    def adam_step(self, lr: float, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> int:
        """Adam on the rows the last step used (no weight decay, as the tables train in pre-training); returns how
        many moved. Clears the gradient and the step's rows."""
        grad, used = self.values.grad, self.used
        self.used = self.used[:0]
        if grad is None or not used.numel():
            return 0
        b1, b2 = betas
        g = grad[used]
        self.exp_avg[used] = self.exp_avg[used] * b1 + g * (1 - b1)
        self.exp_avg_sq[used] = self.exp_avg_sq[used] * b2 + g * g * (1 - b2)
        self.steps[used] += 1
        t = self.steps[used].unsqueeze(1).float()
        m_hat = self.exp_avg[used] / (1 - b1 ** t)
        v_hat = self.exp_avg_sq[used] / (1 - b2 ** t)
        self.values[used] -= lr * m_hat / (v_hat.sqrt() + eps)
        self.values.grad = None
        return int(used.numel())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"rows": self.rows, "values": self.values.detach(), "exp_avg": self.exp_avg,
                "exp_avg_sq": self.exp_avg_sq, "steps": self.steps}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.rows, self.steps = state["rows"].long(), state["steps"].long()
        self.values = state["values"].float().clone().requires_grad_()
        self.exp_avg, self.exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
        self.used = self.rows[:0]


__all__ = ["TrainedRows"]
