"""What n-gram speculative decoding buys one stream, and what it costs where drafts fail.

    python benchmarks/speculative.py --model b [--rounds 3] [--k 4] [--json FILE]

Input-grounded tasks (written for this benchmark: extract fields as JSON, correct a
paragraph, rename a variable in code, answer by quoting a passage), each as one stream through
the model's chat template, greedy; then the random-prompt control (benchmarks/workload.py:
nothing to copy) as one stream and as 64 at once. Greedy, SmolLM2 falls into a loop on random
prompts, which drafts predict; so the one stream also runs sampled (seeded, temperature 1): the
non-repetitive case, where drafts fail and the per-request turn-down has to keep their cost
down. Every case runs with and without `speculative_config` in the same process, in
alternating order, round after round; the table gives the best round's tokens/s of each, their
ratio, the acceptance rate and the drafts per emitted token, and the tasks together (their
tokens over the sum of their best times). Outputs must be equal (greedy, and seeded sampling:
noise is drawn per position), and the script says so where they are not (bf16: a
several-token chunk may round differently from a one-token step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncengine import LLM, SamplingParams
from benchmarks.models import describe, model_dir
from benchmarks.workload import DTYPE, make_workload

PASSAGE = (
    "The Riverside Community Library will host its annual book fair from Friday, March 14 "
    "to Sunday, March 16, 2025. Doors open at 9:30 AM each day and close at 6:00 PM, except "
    "on Sunday, when the fair ends at 4:00 PM. Admission is free for members; non-members pay "
    "a $5 entry fee, which is waived for children under 12. The fair is organised by Maria "
    "Alvarez, the library's events coordinator, who can be reached at (555) 013-2748 or "
    "events@riversidelib.org. Proceeds from book sales will fund the new children's reading "
    "room, scheduled to open in September 2025."
)

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    if subtotal > 100:
        discount = subtotal * 0.05
    else:
        discount = 0
    return subtotal + tax - discount
"""

PARAGRAPH = (
    "Their are many reasons why people enjoys walking in the park. First, it help them to "
    "relax after a long day of work. Second, walking is a good exercise that dont require "
    "any special equipments. Finally, the park is a place were people can meet there "
    "neighbours and make new friend."
)

TASKS: dict[str, str] = {
    "extract-json": (
        f"{PASSAGE}\n\nExtract these fields from the text above as a JSON object: event, "
        "start_date, end_date, opening_time, closing_time, organiser, phone, email, "
        "entry_fee. Copy the values exactly as they are written."
    ),
    "correct": f"Correct the grammar and spelling of this paragraph:\n\n{PARAGRAPH}",
    "rename": (
        f"```python\n{CODE}```\n\nRename the variable `subtotal` to `net_amount` in this "
        "function. Reply with the whole function and nothing else."
    ),
    "quote": (
        f"{PASSAGE}\n\nWho organises the fair and how can she be reached? Answer by quoting "
        "the sentence of the text that says it."
    ),
}


def run_case(
    llm: LLM, prompts: list[Any], params: SamplingParams, chat: bool
) -> tuple[float, list[list[int]], int, int]:
    """Seconds, outputs, and the drafts verified and accepted in the run."""
    before = llm.statistics()
    start = time.perf_counter()
    if chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.statistics()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    drafted = after.num_draft_tokens - before.num_draft_tokens
    return seconds, tokens, drafted, after.num_accepted_tokens - before.num_accepted_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--streams", type=int, default=64, help="the control's batch")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    folder = model_dir(args.model)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
            "prompt_lookup_max": args.lookup_max}  # fmt: skip
    engines = {
        "plain": LLM(folder, dtype=DTYPE, device="cpu"),
        "spec": LLM(folder, dtype=DTYPE, device="cpu", speculative_config=spec),
    }
    vocab = engines["plain"].engine.config.model_config.vocab_size
    control = make_workload(vocab, num_requests=args.streams)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    fixed = SamplingParams(temperature=0.0, max_tokens=control.output_len, ignore_eos=True)
    cases: list[tuple[str, list[Any], SamplingParams, bool]] = [
        (name, [prompt], greedy, True) for name, prompt in TASKS.items()
    ]
    cases.append(("control, 1 stream", control.prompts[:1], fixed, False))
    # A seeded request draws the same noise per position with or without speculation.
    sampled = SamplingParams(
        temperature=1.0, seed=0, max_tokens=control.output_len, ignore_eos=True
    )
    cases.append(("control, 1 stream, sampled", control.prompts[:1], sampled, False))
    cases.append((f"control, {args.streams} streams", control.prompts, fixed, False))

    for llm in engines.values():  # warm-up
        run_case(llm, [TASKS["quote"]], SamplingParams(temperature=0.0, max_tokens=8), True)

    rows: list[dict[str, Any]] = []
    for name, prompts, params, chat in cases:
        best = {"plain": float("inf"), "spec": float("inf")}
        outputs: dict[str, list[list[int]]] = {}
        drafted = accepted = 0
        for r in range(args.rounds):
            order = ("plain", "spec") if r % 2 == 0 else ("spec", "plain")
            for which in order:
                seconds, tokens, d, a = run_case(engines[which], prompts, params, chat)
                best[which] = min(best[which], seconds)
                outputs[which] = tokens
                drafted, accepted = drafted + d, accepted + a
        num_tokens = sum(len(t) for t in outputs["plain"])
        row = {
            "case": name,
            "tokens": num_tokens,
            "plain_tok_s": num_tokens / best["plain"],
            "spec_tok_s": sum(len(t) for t in outputs["spec"]) / best["spec"],
            "acceptance": accepted / drafted if drafted else 0.0,
            "acceptance_drafted": drafted,
            "acceptance_accepted": accepted,
            "drafted_per_token": drafted / (args.rounds * max(num_tokens, 1)),
            "same_tokens": outputs["plain"] == outputs["spec"],
        }
        row["ratio"] = row["spec_tok_s"] / row["plain_tok_s"]
        rows.append(row)
        print(f"{name}: {row['ratio']:.2f}x, acceptance {row['acceptance']:.2f}", flush=True)

    tasks = [row for row in rows if row["case"] in TASKS]
    together = {"case": "the tasks together", "tokens": sum(row["tokens"] for row in tasks)}
    for which in ("plain", "spec"):
        seconds = sum(row["tokens"] / row[f"{which}_tok_s"] for row in tasks)
        together[f"{which}_tok_s"] = together["tokens"] / seconds
    together["ratio"] = together["spec_tok_s"] / together["plain_tok_s"]
    together["same_tokens"] = all(row["same_tokens"] for row in tasks)
    drafted = sum(row["acceptance_drafted"] for row in tasks)
    together["acceptance"] = sum(row["acceptance_accepted"] for row in tasks) / max(drafted, 1)
    together["drafted_per_token"] = drafted / (args.rounds * max(together["tokens"], 1))
    rows.insert(len(tasks), together)

    print(f"\n{describe(args.model)}, {DTYPE}, k={args.k}, prompt_lookup_max={args.lookup_max}, "
          f"best of {args.rounds} rounds\n")  # fmt: skip
    print(
        "| case | tokens | tok/s without | tok/s with | ratio | acceptance | drafts per token "
        "| same tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        print(
            f"| {row['case']} | {row['tokens']} | {row['plain_tok_s']:.1f} | "
            f"{row['spec_tok_s']:.1f} | {row['ratio']:.2f}x | {row['acceptance']:.2f} | "
            f"{row['drafted_per_token']:.2f} | {'yes' if row['same_tokens'] else 'no'} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=2))  # fmt: skip
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
