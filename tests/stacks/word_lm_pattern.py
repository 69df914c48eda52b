"""A training script with the shape and defaults of pytorch/examples' `word_language_model/main.py`
under `--model Transformer`, written here (not its code).

What of it matters to hookpolicy, kept as it is there: an `nn.TransformerEncoder` language model
(token embedding scaled by sqrt(d), sinusoidal positions with dropout, a causal mask, a linear
decoder and `log_softmax`, `NLLLoss`), batches of `bptt` tokens from a corpus laid out in
`batch_size` columns, and no optimizer: after `loss.backward()` the script clips with
`clip_grad_norm_(model.parameters(), clip)` and updates every parameter by hand,
`p.data.add_(p.grad, alpha=-lr)`, with `lr = 20` and `clip = 0.25` (its defaults); after each
epoch it evaluates on held-out text and divides `lr` by 4 when the validation loss did not
improve. The corpus is synthetic (a seeded random bigram chain over `--ntokens` symbols, so the
loss has a floor) and the sizes are small for a CPU.

It prints one JSON line per batch, `{"step", "loss", "updated"}` (`updated`: whether the
decoder's weight changed, read by the script itself), `{"epoch", "val_loss", "lr"}` after each epoch, and `{"final": true, "val_loss"}` at the end: the best
validation loss, that of the model main.py saves and loads back for its test.
"""

import argparse
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--ntokens", type=int, default=2000)
parser.add_argument("--emsize", type=int, default=128)
parser.add_argument("--nhead", type=int, default=2)
parser.add_argument("--nhid", type=int, default=128)
parser.add_argument("--nlayers", type=int, default=2)
parser.add_argument("--lr", type=float, default=20.0)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch_size", type=int, default=20)
parser.add_argument("--bptt", type=int, default=35)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--tokens", type=int, default=40_000, help="length of the training text")
parser.add_argument("--seed", type=int, default=1111)
parser.add_argument("--skip", default="", help="steps whose update this script leaves out by hand, comma-separated "
                    "(a test's reference: the gradients zeroed after backward, as a skipped step's are)")
args = parser.parse_args()
torch.manual_seed(args.seed)


def chain(length: int, seed: int) -> torch.Tensor:
    """A seeded random bigram chain: each token's successor drawn from a random row over Zipf's
    word frequencies (so a model learns the frequencies first, as on real text, then the pairs)."""
    g = torch.Generator().manual_seed(seed)
    zipf = -torch.log(torch.arange(1, args.ntokens + 1, dtype=torch.float))
    rows = torch.softmax(zipf + 2.0 * torch.randn(args.ntokens, args.ntokens, generator=g), dim=1)
    draws = torch.multinomial(rows, length, replacement=True, generator=g)  # per token, its successors
    out = torch.empty(length, dtype=torch.long)
    out[0] = 0
    for i in range(1, length):
        out[i] = draws[out[i - 1], i]
    return out


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous()


text = chain(args.tokens + args.tokens // 4, args.seed)
train_data = batchify(text[: args.tokens], args.batch_size)
val_data = batchify(text[args.tokens:], 10)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout: float, max_len: int = 5000) -> None:
        super().__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0).transpose(0, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.pe[: x.size(0), :])


class TransformerModel(nn.Module):
    def __init__(self, ntoken: int, ninp: int, nhead: int, nhid: int, nlayers: int, dropout: float) -> None:
        super().__init__()
        self.pos_encoder = PositionalEncoding(ninp, dropout)
        layer = nn.TransformerEncoderLayer(ninp, nhead, nhid, dropout)
        self.encoder = nn.TransformerEncoder(layer, nlayers, enable_nested_tensor=False)
        self.input_emb = nn.Embedding(ntoken, ninp)
        self.ninp = ninp
        self.decoder = nn.Linear(ninp, ntoken)
        nn.init.uniform_(self.input_emb.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(len(src))
        src = self.pos_encoder(self.input_emb(src) * math.sqrt(self.ninp))
        return F.log_softmax(self.decoder(self.encoder(src, mask=mask)), dim=-1)


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(args.bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


model = TransformerModel(args.ntokens, args.emsize, args.nhead, args.nhid, args.nlayers, args.dropout)
criterion = nn.NLLLoss()


def evaluate(source: torch.Tensor) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, source.size(0) - 1, args.bptt):
            data, targets = get_batch(source, i)
            total += len(data) * criterion(model(data).view(-1, args.ntokens), targets).item()
    return total / (len(source) - 1)


skip = {int(s) for s in args.skip.split(",") if s}
lr = args.lr
best_val = None
step = 0
for epoch in range(1, args.epochs + 1):
    model.train()
    for i in range(0, train_data.size(0) - 1, args.bptt):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        output = model(data).view(-1, args.ntokens)
        loss = criterion(output, targets)
        loss.backward()
        if step in skip:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        before = model.decoder.weight.detach().clone()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        updated = not torch.equal(before, model.decoder.weight.detach())
        print(json.dumps({"step": step, "loss": loss.item(), "updated": updated}), flush=True)
        step += 1
    val_loss = evaluate(val_data)
    print(json.dumps({"epoch": epoch, "val_loss": val_loss, "lr": lr}), flush=True)
    if best_val is None or val_loss < best_val:
        best_val = val_loss
    else:
        lr /= 4.0
print(json.dumps({"final": True, "val_loss": best_val}), flush=True)
