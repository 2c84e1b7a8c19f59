"""A stand-in rollout-engine worker for the weight-sync tests: a real process holding a real
transformers model, joined to its engine's weight group, loading every sync in place.

Run as `python weight_sync_engine.py '<json args>'`. It prints one JSON line when its model is built
(`{"ready": true}`), then reads commands from stdin, one per line:
- `join`: open the group (blocks until the trainer opens it too), then print `{"joined": true}`;
- `receive`: receive one sync, save the model's (or adapter's) tensors to `<out>/v<version>.pt`
  and print the receive report;
- `exit`.
Args: address (GroupAddress fields), rank, seed (the random init, different from the trainer's),
lora (wrap in the same LoRA config as the trainer and load only the adapter), out (a folder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

from rljob_trainer.weights import weight_sync


def build_model(seed: int, lora: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        )
    return model


def main() -> None:
    args = json.loads(sys.argv[1])
    model = build_model(int(args["seed"]), bool(args.get("lora")))
    if args.get("lora"):
        from peft import get_peft_model_state_dict

        load = weight_sync.peft_adapter_loader(model)

        def snapshot() -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    else:
        load = weight_sync.module_loader(model)

        def snapshot() -> dict[str, torch.Tensor]:
            return {k: v.clone() for k, v in model.state_dict().items()}

    out = Path(args["out"])
    print(json.dumps({"ready": True}), flush=True)
    group = None
    for line in sys.stdin:
        command = line.strip()
        if command == "join":
            group = weight_sync.open_group(weight_sync.GroupAddress(**args["address"]), int(args["rank"]))
            print(json.dumps({"joined": True}), flush=True)
        elif command == "receive":
            assert group is not None, "join before receive"
            report = weight_sync.receive_weights(group, load)
            torch.save(snapshot(), out / f"v{report.version}.pt")
            print(
                json.dumps({"version": report.version, "tensors": report.tensors, "bytes": report.nbytes}),
                flush=True,
            )
        elif command == "exit":
            break


if __name__ == "__main__":
    main()
