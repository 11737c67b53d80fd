"""`helexa acp`: a coding agent for editors that speak the Agent Client Protocol (Zed first).

The editor starts it over stdio; it drives any configured model endpoint (a helexa gateway
or node, OpenAI, Anthropic, OpenRouter, LM Studio) through one of three wire APIs and works
on the user's project with tools. Rooms: `config` (the endpoints), `paths` (where paths,
plans and sessions live), `tools` (what the model can call). A client of the APIs, never of
helexa's engine, node or gateway services.
"""
