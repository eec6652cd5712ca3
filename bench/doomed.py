"""A bare process with the pipeline loaded, generating until it is killed: the floor under the fault figures.

`python -m bench.doomed FD MODEL_PATH DEVICE` writes one byte to FD once it generates, then never stops. The baseline
kills it and times how long the kernel takes to close FD: no server can report a death before that.
"""

import socket
import sys

import openvino_genai


def main() -> None:
    channel = socket.socket(fileno=int(sys.argv[1]))
    pipe = openvino_genai.ContinuousBatchingPipeline(sys.argv[2], openvino_genai.SchedulerConfig(), sys.argv[3], {})
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = 4000
    channel.sendall(b"r")
    while True:
        pipe.generate(["Tell me something."], [config])


if __name__ == "__main__":
    main()
