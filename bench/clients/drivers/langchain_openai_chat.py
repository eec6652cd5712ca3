"""A langchain-openai program, as its users write one: ChatOpenAI at a base URL, a text turn, or a tool bound with
bind_tools and run on the model's call, its result sent back for the answer. Run by bench.clients in the venv of
the langchain-openai release under test: `python langchain_openai_chat.py PROMPT` with OPENAI_BASE_URL, MODEL
and (for the round trip) WITH_TOOL=1."""

import os
import sys

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def read_file(path: str) -> str:
    """Read a text file and return its contents."""
    with open(path) as file:
        return file.read()


def main() -> None:
    chat = ChatOpenAI(model=os.environ["MODEL"], base_url=os.environ["OPENAI_BASE_URL"], api_key="unused",
                      streaming=True, max_retries=0)
    messages = [HumanMessage(sys.argv[1])]
    if os.environ.get("WITH_TOOL"):
        chat = chat.bind_tools([read_file])
        first = chat.invoke(messages)
        messages.append(first)
        for call in first.tool_calls:
            messages.append(ToolMessage(read_file.invoke(call["args"]), tool_call_id=call["id"]))
    print(chat.invoke(messages).content)


if __name__ == "__main__":
    main()
