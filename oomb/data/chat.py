"""Chat and prompt/completion rows -> token ids and per-token labels.

A ``messages`` row (a list of ``{"role", "content"}``) is rendered with the tokenizer's chat template (or the
``chat_template`` given), then tokenised once with character offsets. The labels come from the rendered text's
spans, so any template works, also one without generation markers: the conversation is rendered prefix by
prefix (``messages[:1]``, ``messages[:2]``, ...), each render must begin with the one before it, and message
``i`` owns the characters the render grows by when it is added. Inside an assistant message's span the content
(found verbatim, or stripped as templates that ``trim`` it render it) and the end-of-turn text after it are
trained: up to and including the first special token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``), or, where the
span holds no special token after the content, up to and including its last non-blank character (the same
``<|im_end|>`` as plain text, for a tokenizer that lacks that special token; a warning says so, as it says when
the template renders nothing after the content). Its header (``<|im_start|>assistant\\n``), the blank text
after its end of turn and everything of the other roles get label -100. A token is trained when its characters
overlap a trained span.

A ``prompt``/``completion`` row of strings is ``prompt`` then ``completion`` then the EOS token, the completion
and EOS trained; a row whose prompt and completion are message lists is the conversation ``prompt +
completion`` with the completion's assistant messages trained.

A ``segments`` row (a list of ``{"text": str, "label": bool}``, Axolotl's template-free ``input_output``
format) is each segment's text tokenised on its own, without special tokens, concatenated, then the EOS token;
the segments with ``"label": true`` are trained, and the EOS where the last segment is. No template and no
role markers: the row says exactly which tokens carry the loss, also several spans of one example (e.g. many
answers in one long context).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

from .errors import DataError

__all__ = ["IGNORE_INDEX", "ROLES", "check_messages", "check_segments", "encode_messages", "encode_prompt_completion",
           "encode_segments", "encode_text", "read_chat_template"]

IGNORE_INDEX = -100
_MARKER = "\u2063oomb-content-marker\u2063"
ROLES = ("system", "user", "assistant", "tool")
"""The roles a ``messages`` row may have."""


def read_chat_template(path: str | None) -> str | None:
    """The Jinja text of a ``chat_template`` file (a ``.jinja`` text file, or a ``tokenizer_config.json``-style
    JSON object with a ``chat_template`` key); None: None.

    Raises:
        DataError: the file cannot be read, holds no template, or its template does not compile (a Jinja syntax
            error).
    """
    if path is None:
        return None
    import json
    from pathlib import Path

    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {{chat_template}} {path!r} ({getattr(exc, 'strerror', None) or exc})",
                        "set {chat_template} to a Jinja chat template file", setting="chat_template") from exc
    if p.suffix.lower() == ".json":
        try:
            text = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            text = None
        if not isinstance(text, str):
            raise DataError(f"{{chat_template}} {path!r} has no string \"chat_template\" key",
                            "set {chat_template} to a Jinja chat template file, or a JSON file with a \"chat_template\" "
                            "key", setting="chat_template")
    if not text.strip():
        raise DataError(f"{{chat_template}} {path!r} is empty", "set {chat_template} to a Jinja chat template file",
                        setting="chat_template")
    _check_compiles(text, path)
    return text


def _check_compiles(template: str, path: str) -> None:
    """Refuse a chat template that Jinja cannot compile (a syntax error), naming the file and the line, before any
    row is rendered with it."""
    try:
        from jinja2 import TemplateSyntaxError
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: the first render says what is wrong
        return
    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as exc:
        msg = " ".join(str(exc.message or exc).split())
        raise DataError(f"{{chat_template}} {path!r} is not a valid Jinja template (line {exc.lineno}: {msg})",
                        "fix the template's syntax, or set {chat_template} to another template file",
                        setting="chat_template") from exc


def _refuse_json_text(value, name: str, where: str) -> None:
    """Refuse a ``messages`` or ``segments`` field that is a string holding a JSON list (as a CSV cell holds it,
    being text only), saying how to give the list itself."""
    import json

    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except ValueError:
            return
        if isinstance(parsed, list):
            raise DataError(f"{where}: {name} is a string of JSON text, not a list",
                            f"write {name} as a list itself, in JSON Lines or parquet rows (a CSV cell holds only text)")


def check_messages(messages, where: str) -> None:
    """Refuse a ``messages`` value that is not a list of ``{"role": one of ROLES, "content": str}``.

    Raises:
        DataError: naming ``where`` (the row) and the bad message.
    """
    _refuse_json_text(messages, "messages", where)
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: messages is {type(messages).__name__ if messages else 'empty'}, not a list of messages",
                        'write messages as a list of {"role": ..., "content": ...}')
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {j} is not an object with \"role\" and \"content\"",
                            'write messages as a list of {"role": ..., "content": ...}')
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {j} has the unknown role {m['role']!r}",
                            f"use one of the roles {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {j} ({m['role']}) has content of type {type(m['content']).__name__}, "
                            "not a string", "write each message's content as a string")


def _special_strings(tokenizer) -> list[str]:
    out = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            out.add(tok.content)
    return sorted((s for s in out if s), key=len, reverse=True)


def _render(tokenizer, messages: Sequence[dict], template: str | None, where: str) -> str:
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, chat_template=template)
    except Exception as exc:  # jinja2 errors, the template's raise_exception
        msg = " ".join(str(exc).split()) or type(exc).__name__
        raise DataError(f"{where}: the chat template cannot render this conversation ({msg})",
                        "fix the row, or set {chat_template} to a template for these roles", setting="chat_template") from exc
    if not isinstance(text, str):
        raise DataError(f"{where}: the chat template did not render text", "set {chat_template} to a Jinja template",
                        setting="chat_template")
    return text


def _trained_spans(tokenizer, messages: Sequence[dict], template: str | None, where: str,
                   trained: Sequence[bool]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[a, b)`` of the trained messages' content and their
    end-of-turn text."""
    specials = _special_strings(tokenizer)
    renders = [_render(tokenizer, messages[: i + 1], template, where) for i in range(len(messages))]
    full = renders[-1]
    spans = []
    prev = ""
    prev_of = [""] + renders[:-1]
    for i, (m, r) in enumerate(zip(messages, renders)):
        if not r.startswith(prev):
            raise DataError(f"{where}: the chat template renders message {i - 1} differently once message {i} "
                            "follows, so the messages' spans cannot be told apart",
                            "set {chat_template} to a template that renders each turn the same way whatever follows",
                            setting="chat_template")
        start, end = len(prev), len(r)
        prev = r
        if not trained[i]:
            continue
        # Where the content goes: render the message with a marker for its content; the text before the
        # marker is the message's header (a content that also occurs in its header is not mistaken for it).
        marked = _render(tokenizer, [*messages[:i], {**m, "content": _MARKER}], template, where)
        at = marked.find(_MARKER, start)
        header = marked[start:at] if at >= 0 and marked.startswith(prev_of[i]) else None
        span = full[start:end]
        content = m["content"]
        if header is None or not span.startswith(header):
            raise DataError(f"{where}: the chat template does not render message {i}'s content where it renders "
                            "other content", "set {chat_template} to a template that writes each message's content "
                            "verbatim", setting="chat_template")
        body = span[len(header):]
        if not body.startswith(content):
            content = content.strip()
            if not body.startswith(content):
                raise DataError(f"{where}: the chat template does not render message {i}'s content as it is",
                                "set {chat_template} to a template that writes each message's content verbatim",
                                setting="chat_template")
        a = start + len(header)
        b = a + len(content)
        end_of_turn = _end_of_turn(full[b:end], specials)
        _check_end_of_turn(tokenizer, end_of_turn, specials)
        spans.append((a, b + len(end_of_turn)))
    return full, spans


def _end_of_turn(rest: str, specials: Sequence[str]) -> str:
    """The end-of-turn text of ``rest`` (what the template renders after an assistant message's content, up to
    the next message): up to and including its first special token; where it holds none, up to and including its
    last non-blank character (``<|im_end|>`` of ``<|im_end|>\\n`` for a tokenizer without that special token)."""
    hits = [(rest.find(s), s) for s in specials if rest.find(s) >= 0]
    if hits:
        pos, s = min(hits, key=lambda h: (h[0], -len(h[1])))
        return rest[: pos + len(s)]
    return rest.rstrip()


def _check_end_of_turn(tokenizer, end_of_turn: str, specials: Sequence[str]) -> None:
    """Warn (once per text, as Python's warnings filter does) where the end of an assistant turn is no special
    token: nothing at all, or plain text that a generator stops at only as a stop string."""
    if not end_of_turn.strip():
        warnings.warn("the chat template renders nothing after an assistant message's content, so no end-of-turn "
                      "token is trained and the model does not learn to end its turn; pass --chat-template one that "
                      "ends each turn with a marker (e.g. the model's)", stacklevel=4)
    elif not any(s in end_of_turn for s in specials):
        n = len(tokenizer(end_of_turn.strip(), add_special_tokens=False)["input_ids"])
        warnings.warn(f"the chat template ends an assistant turn with {end_of_turn.strip()!r}, which this tokenizer "
                      f"has as {n} token{'s' if n != 1 else ''} of plain text, not a special token: it is trained as "
                      "text, and generation stops at it only as a stop string; pass --tokenizer one that has it as a "
                      "special token (e.g. the model's) to train one end-of-turn token", stacklevel=4)


def _labels_from_spans(tokenizer, text: str, spans: list[tuple[int, int]], where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError as exc:
        raise DataError(f"{where}: the tokenizer gives no character offsets (a slow tokenizer)",
                        "pass --tokenizer a folder with tokenizer.json (a fast tokenizer)") from exc
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    labels = np.full_like(ids, IGNORE_INDEX)
    offsets = enc["offset_mapping"]
    for k, (s, e) in enumerate(offsets):
        if e <= s:
            continue
        if any(s < b and e > a for a, b in spans):
            labels[k] = ids[k]
    return ids, labels


def encode_messages(tokenizer, messages: Sequence[dict], template: str | None, loss_on: str, where: str,
                    trained_from: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and labels (int64 ``[n]`` each, -100 = no loss) of one conversation.

    ``loss_on``: "assistant" (the assistant messages from index ``trained_from`` on, content and end-of-turn
    text, see the module) or "all" (every token).

    Raises:
        DataError: a bad message, a template that cannot render it, or one whose renders are not prefixes of each
            other.
    """
    check_messages(messages, where)
    trained = [loss_on != "all" and m["role"] == "assistant" and i >= trained_from for i, m in enumerate(messages)]
    text, spans = _trained_spans(tokenizer, messages, template, where, trained)
    ids, labels = _labels_from_spans(tokenizer, text, spans, where)
    if loss_on == "all":
        labels = ids.copy()
    return ids, labels


def encode_prompt_completion(tokenizer, prompt, completion, template: str | None, loss_on: str,
                             where: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and labels of one ``prompt``/``completion`` row (strings, or message lists).

    Raises:
        DataError: prompt and completion are neither both strings nor both message lists.
    """
    if isinstance(prompt, str) and isinstance(completion, str):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"]
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        ids = np.asarray(p + c + eos, dtype=np.int64)
        labels = ids.copy()
        if loss_on != "all":
            labels[: len(p)] = IGNORE_INDEX
        return ids, labels
    if isinstance(prompt, (list, tuple)) and isinstance(completion, (list, tuple)):
        return encode_messages(tokenizer, list(prompt) + list(completion), template, loss_on, where,
                               trained_from=len(prompt))
    raise DataError(f"{where}: prompt is {type(prompt).__name__} and completion is {type(completion).__name__}",
                    "write both as strings, or both as lists of messages")


def check_segments(segments, where: str) -> None:
    """Refuse a ``segments`` value that is not a non-empty list of ``{"text": str, "label": bool}``.

    Raises:
        DataError: naming ``where`` (the row) and the bad segment.
    """
    fix = 'write segments as a list of {"text": "...", "label": true|false}'
    _refuse_json_text(segments, "segments", where)
    if not isinstance(segments, (list, tuple)) or not segments:
        what = "null" if segments is None else "empty" if isinstance(segments, (list, tuple)) else type(segments).__name__
        raise DataError(f"{where}: segments is {what}, not a list of segments", fix)
    for j, seg in enumerate(segments):
        if not isinstance(seg, dict) or "text" not in seg or "label" not in seg:
            raise DataError(f"{where}: segment {j} is not an object with \"text\" and \"label\"", fix)
        if not isinstance(seg["text"], str):
            raise DataError(f"{where}: segment {j} has text of type {type(seg['text']).__name__}, not a string", fix)
        if not isinstance(seg["label"], bool):
            raise DataError(f"{where}: segment {j} has label {seg['label']!r}, not true or false", fix)
        if seg["label"] and not seg["text"]:
            raise DataError(f"{where}: segment {j} is labelled true but its text is empty, so it trains nothing",
                            "give the labelled segment its text, or label it false")


def encode_segments(tokenizer, segments, loss_on: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and labels (int64 ``[n]`` each, -100 = no loss) of one ``segments`` row (see the module).

    ``loss_on``: "assistant" (the segments labelled true, and the EOS where the last one is) or "all".

    Raises:
        DataError: a bad segment (:func:`check_segments`).
    """
    check_segments(segments, where)
    encoded = tokenizer([seg["text"] for seg in segments], add_special_tokens=False)["input_ids"]
    ids, labels = [], []
    for seg, part in zip(segments, encoded):
        ids += part
        labels += part if seg["label"] else [IGNORE_INDEX] * len(part)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id if segments[-1]["label"] else IGNORE_INDEX)
    ids = np.asarray(ids, dtype=np.int64)
    return ids, (ids.copy() if loss_on == "all" else np.asarray(labels, dtype=np.int64))


def encode_text(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """A text document as one example: its tokens then the EOS token, every token trained."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    ids = np.asarray(ids, dtype=np.int64)
    return ids, ids.copy()
