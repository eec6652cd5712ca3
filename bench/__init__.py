"""`python -m bench`: what the appliance costs over running OpenVINO GenAI in process, and how fast it fails and heals.

Every figure is measured in one run against its own baseline (the same tiny demo model, the same prompts, warm),
so the table holds ratios and latency distributions rather than absolute speeds of this particular machine.
"""
