"""The Tinker API's binary bodies: the ``forward_backward`` request and the ``ForwardBackwardOutput`` /
``SampleResponse`` results, in the SDK's own protobuf schema (``tinker.proto.tinker_public_pb2``: being compatible
means speaking the SDK's schema, so it is imported, not rewritten).

* request: ``ForwardBackwardRequest`` (zstd-compressed when the client sends ``Content-Encoding: zstd``): per datum the
  ``model_input`` chunks (only ``encoded_text``: int32 token ids) and ``loss_fn_inputs`` tensors (dense or sparse CSR;
  float32 or int64), ``loss_fn`` and its config (``loss_fn_config_v2`` preferred, as the SDK says servers do);
* results: one ``ArrayRecord`` holding every datum's ``logprobs`` (float32, concatenated, with byte offsets), and the
  metrics; a ``SampleResponse`` with each sequence's int32 tokens and float32 log-probs, and NaN at the prompt's first
  position when prompt log-probs were asked for.
"""

from __future__ import annotations

import numpy as np
import torch

from prefzoo.errors import PrefzooError

__all__ = ["WireError", "decode_forward_backward", "encode_forward_backward_output", "encode_sample_response"]


class WireError(PrefzooError):
    """A body that is not a well-formed Tinker request (or asks for what this server does not take, e.g. images)."""


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def _tensor(msg, where: str) -> torch.Tensor:
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: (np.float32, torch.float32), pb.DTYPE_INT64: (np.int64, torch.long),
              pb.DTYPE_INT32: (np.int32, torch.long)}
    if msg.dtype not in dtypes:
        raise WireError(f"{where}: tensor dtype {msg.dtype} is not float32 / int64.")
    np_dtype, torch_dtype = dtypes[msg.dtype]
    shape = tuple(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=np_dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise WireError(f"{where}: a sparse CSR tensor of shape {shape} with {len(crow)} row pointers and "
                            f"{len(col)} column indices for {len(values)} values.")
        dense = np.zeros(shape, dtype=np_dtype)
        for r in range(shape[0]):
            lo, hi = int(crow[r]), int(crow[r + 1])
            dense[r, col[lo:hi]] = values[lo:hi]
        array = dense
    else:
        array = np.frombuffer(msg.dense, dtype=np_dtype)
        if shape:
            if int(np.prod(shape)) != array.size:
                raise WireError(f"{where}: {array.size} values for shape {shape}.")
            array = array.reshape(shape)
    return torch.from_numpy(array.copy()).to(torch_dtype)


def decode_forward_backward(body: bytes, content_encoding: str | None) -> dict:
    """A ``forward_backward`` body as ``{model_id, seq_id, loss_fn, loss_fn_config, forward_only, data}`` with data a
    list of (token ids, {name: tensor}); WireError if it is not one."""
    if content_encoding and content_encoding.lower() == "zstd":
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompressobj().decompress(body)
        except zstandard.ZstdError as err:
            raise WireError(f"the zstd body does not decompress: {err}") from None
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # google.protobuf.message.DecodeError
        raise WireError(f"the forward_backward body is not a ForwardBackwardRequest protobuf: {err}") from None
    config: dict[str, float | str] = {k: v for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = []
    for i, datum in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"datum {i}: a model_input chunk of kind {kind!r}; this server takes token chunks "
                                "(EncodedTextChunk) only.")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: _tensor(t, f"datum {i} loss_fn_inputs[{name!r}]") for name, t in datum.loss_fn_inputs.items()}
        data.append((tokens, inputs))
    return {"model_id": msg.model_id, "seq_id": msg.seq_id, "loss_fn": msg.loss_fn, "loss_fn_config": config,
            "forward_only": msg.forward_only, "data": data}


def encode_forward_backward_output(logprobs: list[torch.Tensor], metrics: dict[str, float]) -> bytes:
    """``ForwardBackwardOutput``: one ArrayRecord with each datum's ``logprobs`` (float32) and the metrics."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    record = out.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(logprobs)
    arrays = [lp.detach().cpu().numpy().astype(np.float32) for lp in logprobs]
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    field = record.fields["logprobs"]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = offsets.tobytes()
    field.dtype = pb.DTYPE_FLOAT32
    return out.SerializeToString()


def encode_sample_response(tokens: list[list[int]], logprobs: list[list[float]], stop_reasons: list[str],
                           prompt_logprobs: list[float] | None) -> bytes:
    """``SampleResponse``: per sequence int32 tokens, float32 log-probs and its stop reason; prompt log-probs (NaN
    at position 0) when given."""
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse()
    for toks, lps, reason in zip(tokens, logprobs, stop_reasons, strict=True):
        seq = out.sequences.add()
        seq.stop_reason = reasons[reason]
        seq.tokens = np.asarray(toks, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(lps, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return out.SerializeToString()
