"""Turn a recording of an agent harness (tests/agents/record.py) into a test fixture.

    python tests/agents/anonymize.py /tmp/rec/claude tests/agents/claude_code.json --harness "claude-code 2.1.332"

The harnesses' own prose (system prompts, instructions, tool and parameter
descriptions) is not ours to copy, so every piece of text is replaced by filler
of the same token length (the embedded default model's tokenizer). The filler is
a pure function of the text it replaces, so a text repeated across requests
stays repeated, and the prefixes a prefix cache would share stay shared. Fields,
roles, tool names, schemas (but their descriptions), call arguments and lengths
are kept; ids that name a machine or an account are zeroed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

WORDS = ("alpha beta gamma delta river stone cloud field north south window garden paper "
         "signal method value token layer block cache agent branch module simple careful "
         "return check write read file line the a of and to in is it for on with as").split()

# Keys whose string values are prose to replace, wherever they sit in a body.
PROSE_KEYS = {"text", "description", "instructions", "system", "content", "output", "thinking"}
# Keys whose values identify a machine, an account or a session: replaced by a fixed stand-in.
IDENTIFYING_KEYS = {"user_id", "x-codex-installation-id", "x-codex-turn-metadata"}


class Filler:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        if text not in self.cache:
            self.cache[text] = self._make(text)
        return self.cache[text]

    def _make(self, text: str) -> str:
        target = len(self.tokenizer.encode(text))
        rng = random.Random(hashlib.sha256(text.encode()).digest())
        words: list[str] = []
        while len(self.tokenizer.encode(" ".join(words))) < target:
            words.append(rng.choice(WORDS) + ("\n" if rng.random() < 0.08 else ""))
        while words and len(self.tokenizer.encode(" ".join(words))) > target:
            words.pop()
        return " ".join(words)


def scrub(value, fill: Filler, key: str | None = None):
    if isinstance(value, dict):
        return {k: scrub(v, fill, k) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, fill, key) for v in value]
    if isinstance(value, str):
        if key in IDENTIFYING_KEYS:
            return "0" * 16
        if key in PROSE_KEYS:
            return fill(value)
    return value


def main() -> None:
    from transformers import AutoTokenizer

    from mlxserve.models.embedded import default_tokenizer_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording", help="a folder of NNN.json files from record.py")
    parser.add_argument("fixture", help="the JSON file to write")
    parser.add_argument("--harness", required=True, help="which harness and version made it")
    parser.add_argument("--note", default="", help="what the session did")
    args = parser.parse_args()
    fill = Filler(AutoTokenizer.from_pretrained(str(default_tokenizer_dir())))
    requests = []
    for path in sorted(Path(args.recording).glob("*.json")):
        record = json.loads(path.read_text())
        requests.append({"path": record["path"], "query": record["query"],
                         "recorded_status": record["status"], "body": scrub(record["body"], fill)})
    fixture = {"harness": args.harness, "note": args.note, "requests": requests}
    Path(args.fixture).write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"{args.fixture}: {len(requests)} requests")


if __name__ == "__main__":
    main()
