"""AuxState: what a decode worker needs, besides the pages, to continue a prefilled request.

The prefill engine makes it when it samples the first token; the transfer carries it ahead
of the pages; the decode engine starts the request from it. Wire form (little endian):

    prompt_len int64 | first_token_id int64 | num hidden values int64 | sender_id 128 bytes
    | hidden values float32 x num
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

_HEADER = struct.Struct("<qqq128s")  # prompt length, first token, hidden values, sender id
MAX_SENDER_BYTES = 128


@dataclass(slots=True)
class AuxState:
    """A prefilled request's hand-over: the prompt length n, the first sampled token t_n,
    and the target's features f_{n-1} at the last prompt position, the drafter's input for
    slot n. ``sender_id`` names the sending worker (at most 128 bytes, "" inside one
    engine), whom the receiver acknowledges."""

    prompt_len: int  # n, in tokens
    first_token_id: int  # t_n, sampled from the prefill's last logits
    hidden: torch.Tensor  # [hidden_size], float32 on the wire
    sender_id: str = ""

    def to_bytes(self) -> bytes:
        values = self.hidden.detach().to("cpu", torch.float32).contiguous()
        sender = self.sender_id.encode()
        if len(sender) > MAX_SENDER_BYTES:
            raise ValueError(f"sender_id: at most {MAX_SENDER_BYTES} bytes, got {len(sender)}")
        header = _HEADER.pack(self.prompt_len, self.first_token_id, values.numel(), sender)
        return header + values.numpy().tobytes()

    @staticmethod
    def from_bytes(data: bytes | bytearray) -> AuxState:
        """Parse :meth:`to_bytes`; ValueError when the hidden values disagree with the header."""
        prompt_len, first_token_id, n, sender = _HEADER.unpack_from(data)
        values = bytearray(data[_HEADER.size :])
        if len(values) % 4:
            raise ValueError(f"aux state: {len(values)} bytes of hidden values are not float32s")
        hidden = torch.frombuffer(values, dtype=torch.float32) if values else torch.zeros(0)
        if hidden.numel() != n:
            raise ValueError(f"aux state: {hidden.numel()} hidden values, header says {n}")
        return AuxState(prompt_len, first_token_id, hidden, sender.rstrip(b"\0").decode())

    @staticmethod
    def wire_size(hidden_size: int) -> int:
        """Bytes of :meth:`to_bytes` for ``hidden_size`` hidden values."""
        return _HEADER.size + 4 * hidden_size
