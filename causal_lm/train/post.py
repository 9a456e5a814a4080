"""Post-training data: chat conversations for SFT, with the loss on the assistant's tokens only.

A conversation is an OpenAI-shaped `messages` list ([{"role": "user", "content": ...}, {"role": "assistant", ...}]).
`encode_conversation` renders it with the tokenizer's chat template (the checkpoint's own, `causal_lm.interop.chat`)
or, for a tokenizer without one (byte, char), with the plain built-in layout

    User: What is 3 + 4?\\n
    Assistant: 3 + 4 = 7. The answer is 7.<EOS>

and returns the token ids with a mask that is True on the assistant's tokens (its reply and the token that ends
its turn, so the model learns to stop): everything else (system, user, the "Assistant:" header the template
writes) is context, never a target. The mask travels through packing beside the tokens
(`causal_lm.data.pipeline.pack(..., mask=...)`), and a target outside it gets weight 0, so the same loss, step and
evaluation as `lm` train and report the assistant-token loss. Each conversation is its own segment of a packed
row: it never attends to its neighbour.

With a template, the assistant's text is found by rendering growing prefixes of the conversation: the text of
messages[:i] with the generation prompt, then messages[:i+1] without it; the difference is the assistant's turn.
Each piece is tokenized apart, so a token never straddles the boundary between context and reply.

Corpora: `data.corpus` = a JSONL file (or several, comma-separated) of {"messages": [...]} records, or
"synthetic-chat": a built-in set of arithmetic conversations made on the fly (the task GRPO then trains on).
"""

from __future__ import annotations

import json
import os

import numpy as np

from causal_lm.config import ConfigError
from causal_lm.data.corpus import DataError, resolve_files
from causal_lm.data.pipeline import DataSplits, TrainIterator, build_data, eval_batches, is_validation, pack
from causal_lm.data.tokenizer import tokenizer_from_spec
from causal_lm.interop.chat import ChatTemplateError, render_chat_template

SYNTHETIC_CHAT = "synthetic-chat"
SYNTHETIC_CONVERSATIONS = 4000
ROLES = ("system", "user", "assistant", "tool")


# ---- the built-in synthetic chat set -------------------------------------------------------------------------


MAX_OPERAND = 50  # the synthetic set's operands are below this


def arithmetic_problem(rng: np.random.Generator, max_operand: int = MAX_OPERAND) -> tuple[str, int]:
    """(question, answer): a sum or difference of two numbers below `max_operand`, asked one of a few ways. A small
    `max_operand` (e.g. 10) is an easy subset of the synthetic set, where a briefly trained model is right about
    half the time: the range in which GRPO's group advantages carry signal."""
    if not isinstance(max_operand, int) or max_operand < 1:
        raise ConfigError(f"max_operand must be a positive integer, got {max_operand!r}")
    a, b = int(rng.integers(0, max_operand)), int(rng.integers(0, max_operand))
    if rng.random() < 0.5:
        op, ans = "+", a + b
    else:
        a, b = max(a, b), min(a, b)
        op, ans = "-", a - b
    forms = [f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"{a} {op} {b} = ?"]
    return forms[int(rng.integers(len(forms)))], ans


def arithmetic_questions(n: int, seed: int = 0, max_operand: int = MAX_OPERAND) -> list[tuple[str, int]]:
    """n (question, answer) problems, the same for a seed: a fixed held-out set to measure a model on."""
    rng = np.random.default_rng([seed, 31])
    return [arithmetic_problem(rng, max_operand) for _ in range(n)]


def arithmetic_reply(question: str, answer: int) -> str:
    """The reply the synthetic set teaches: the equation, then 'The answer is N.'"""
    expr = question.removesuffix(" = ?").removeprefix("What is ").removeprefix("Compute ").rstrip("?.")
    return f"{expr} = {answer}. The answer is {answer}."


def synthetic_conversations(
    n: int = SYNTHETIC_CONVERSATIONS, seed: int = 0, max_operand: int = MAX_OPERAND
) -> list[list[dict]]:
    """n arithmetic conversations (one or two user turns, some with a system message, operands below
    `max_operand`), the same for a seed."""
    rng = np.random.default_rng([seed, 7])
    out = []
    for _ in range(n):
        msgs = []
        if rng.random() < 0.2:
            msgs.append({"role": "system", "content": "You are a careful calculator."})
        for _turn in range(1 + int(rng.random() < 0.3)):
            q, a = arithmetic_problem(rng, max_operand)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": arithmetic_reply(q, a)}]
        out.append(msgs)
    return out


# ---- reading conversations -----------------------------------------------------------------------------------


def check_messages(messages, where: str) -> list[dict]:
    """The messages list of one record, or a DataError naming `where` and what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: message {i} is {json.dumps(m)[:80]}; expected {{'role': one of {ROLES}, 'content': text}}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing to train on")
    return messages


def read_jsonl(spec: str, required: tuple) -> list[dict]:
    """The records of the JSONL files of `spec` (comma-separated paths, directories or globs), each checked to
    have the `required` keys; a DataError naming file and line otherwise."""
    files = resolve_files(spec)
    if not files:
        raise DataError(f"data.corpus={spec!r}: no files")
    records = []
    for path in files:
        if not os.path.isfile(path):
            raise DataError(f"data.corpus: {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
                missing = [k for k in required if not isinstance(rec, dict) or k not in rec]
                if missing:
                    raise DataError(f"{path}:{n}: the record has no {', '.join(map(repr, missing))}")
                rec["_where"] = f"{path}:{n}"
                records.append(rec)
    if not records:
        raise DataError(f"data.corpus={spec!r} holds no records")
    return records


def load_conversations(spec: str, seed: int = 0, max_operand: int = MAX_OPERAND) -> list[list[dict]]:
    """The conversations of a corpus spec: "synthetic-chat" (operands below max_operand) or JSONL files of
    {"messages": [...]}."""
    if spec == SYNTHETIC_CHAT:
        return synthetic_conversations(seed=seed, max_operand=max_operand)
    return [check_messages(r["messages"], r["_where"]) for r in read_jsonl(spec, ("messages",))]


# ---- rendering with the assistant mask -----------------------------------------------------------------------


def _plain_pieces(messages, add_generation_prompt: bool):
    """(text, trained?, end the turn with EOS?) pieces of the built-in layout."""
    out = []
    for m in messages:
        role = m["role"].capitalize()
        if m["role"] == "assistant":
            out += [(f"{role}: ", False, False), (m["content"], True, True)]
        else:
            out.append((f"{role}: {m['content']}\n", False, False))
    if add_generation_prompt:
        out.append(("Assistant: ", False, False))
    return out


def _template_pieces(tokenizer, messages, add_generation_prompt: bool):
    template, specials = tokenizer.chat_template, getattr(tokenizer, "special_tokens", None)

    def render(msgs, gen):
        return render_chat_template(template, msgs, add_generation_prompt=gen, special_tokens=specials) if msgs else ""

    out, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        full = render(messages[: i + 1], False)
        if not (before.startswith(done) and full.startswith(before)):
            raise ChatTemplateError(
                "the chat template does not render a conversation's prefixes as prefixes of it (it rewrites earlier "
                "turns), so the assistant's tokens cannot be located; SFT needs a prefix-stable template"
            )
        out += [(before[len(done) :], False, False), (full[len(before) :], True, False)]
        done = full
    rest = render(messages, add_generation_prompt)
    if len(rest) > len(done):
        out.append((rest[len(done) :], False, False))
    return out


def encode_conversation(tokenizer, messages, add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
    """(token ids, mask): the conversation rendered (chat template, or the plain layout without one) and a mask
    True on the assistant's tokens. add_generation_prompt: end with the header that opens the assistant's turn
    (a prompt for generation: GRPO)."""
    if getattr(tokenizer, "chat_template", None):
        pieces = _template_pieces(tokenizer, messages, add_generation_prompt)
    else:
        pieces = _plain_pieces(messages, add_generation_prompt)
    ids: list[int] = []
    mask: list[bool] = []
    for text, trained, eos in pieces:
        piece = (
            (
                tokenizer.encode_prompt(text)
                if not ids and hasattr(tokenizer, "encode_prompt")
                else tokenizer.encode(text)
            )
            if text
            else []
        )
        if eos:
            piece = piece + [tokenizer.eos_id]
        ids += piece
        mask += [trained] * len(piece)
    return ids, mask


def end_of_turn_ids(tokenizer) -> list[int]:
    """The ids that end an assistant turn (what generation stops at): the tokenizer's stop ids, or EOS."""
    return list(getattr(tokenizer, "stop_ids", None) or [tokenizer.eos_id])


def prompt_ids(tokenizer, messages) -> list[int]:
    """A conversation ending with the user's turn, rendered with the generation prompt: the model replies next."""
    return encode_conversation(tokenizer, messages, add_generation_prompt=True)[0]


# ---- data splits for train.task=sft --------------------------------------------------------------------------


def build_sft_data(config, tokenizer=None, *, max_val_batches: int | None = None) -> DataSplits:
    """Train iterator and validation batches of chat conversations, packed with the assistant mask."""
    d, t = config.data, config.train
    if d.streaming or d.corpus.startswith("hf:"):
        raise ConfigError("train.task=sft reads JSONL conversations or 'synthetic-chat', not a streamed corpus")
    if d.corpus == "builtin":
        raise ConfigError(
            "train.task=sft needs conversations: data.corpus=synthetic-chat (built in) or a JSONL file of "
            '{"messages": [...]} records'
        )
    convs = load_conversations(d.corpus, t.seed, t.max_operand)
    if d.max_documents:
        convs = convs[: d.max_documents]
    if len(convs) < 2:
        raise DataError(f"data.corpus={d.corpus!r}: a validation split needs at least two conversations")
    if tokenizer is None:
        texts = [m["content"] for c in convs for m in c] + ["User: Assistant: System: Tool: \n"]
        tokenizer = tokenizer_from_spec(d.tokenizer, texts if d.tokenizer == "char" else ())
    try:
        encoded = [encode_conversation(tokenizer, c) for c in convs]
    except ChatTemplateError as e:
        raise DataError(f"data.corpus={d.corpus!r}: {e}") from None
    val = is_validation(np.arange(len(encoded)), d.val_fraction)
    if not val.any():
        val[-1] = True
    if val.all():
        val[0] = False

    def gather(ids):
        flat = np.asarray([x for i in ids for x in encoded[i][0]], np.int32)
        mask = np.asarray([x for i in ids for x in encoded[i][1]], bool)
        lengths = np.asarray([len(encoded[i][0]) for i in ids], np.int64)
        return flat, lengths, mask

    train_ids = np.flatnonzero(~val)
    train_ids = train_ids[np.random.default_rng(t.seed).permutation(len(train_ids))]
    f, n, m = gather(train_ids)
    train_rows = pack(f, n, t.seq_len, tokenizer.pad_id, mask=m)
    f, n, m = gather(np.flatnonzero(val))
    val_rows = pack(f, n, t.seq_len, tokenizer.pad_id, mask=m)
    if max_val_batches is None:
        max_val_batches = t.eval_batches
    info = {
        "conversations": len(convs),
        "train_conversations": int(len(train_ids)),
        "val_conversations": int(val.sum()),
        "train_tokens": train_rows.num_target_tokens,  # assistant tokens: the targets
        "val_tokens": val_rows.num_target_tokens,
        "train_rows": len(train_rows),
        "val_rows": len(val_rows),
    }
    return DataSplits(
        tokenizer,
        TrainIterator(train_rows, t.batch_size, t.seed),
        eval_batches(val_rows, t.batch_size, max_val_batches or None),
        info,
    )


def build_task_data(config, tokenizer=None, **kwargs) -> DataSplits:
    """The data of `config.train.task`: packed text for lm, conversations with the assistant mask for sft."""
    if config.train.task == "sft":
        return build_sft_data(config, tokenizer, **kwargs)
    return build_data(config, tokenizer, **kwargs)
