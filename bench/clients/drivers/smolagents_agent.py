"""A smolagents program, as its users write one: a ToolCallingAgent on OpenAIServerModel with one tool (for the
round trip, which the bench does not run: the agent forces a tool call every step, which a demo model never
closes), or the model asked once (a text turn).
Run by bench.clients in the venv of the smolagents release under test: `python smolagents_agent.py PROMPT` with
OPENAI_BASE_URL, MODEL and (for the round trip) WITH_TOOL=1."""

import os
import sys

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


@tool
def read_file(path: str) -> str:
    """Read a text file and return its contents.

    Args:
        path: the file's path
    """
    with open(path) as file:
        return file.read()


def main() -> None:
    model = OpenAIServerModel(model_id=os.environ["MODEL"], api_base=os.environ["OPENAI_BASE_URL"], api_key="unused")
    if os.environ.get("WITH_TOOL"):
        print(ToolCallingAgent(tools=[read_file], model=model, max_steps=2, verbosity_level=0).run(sys.argv[1]))
    else:
        print(model([{"role": "user", "content": [{"type": "text", "text": sys.argv[1]}]}]).content)


if __name__ == "__main__":
    main()
