"""Sixteen tool-calling tasks for ``bench_tools.py``: a user request and 2-4 tools of the usual shapes
(weather, search, calculator, calendar, email, unit conversion, reminders), written for the benchmark."""

from __future__ import annotations


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


WEATHER = _tool("get_weather", "Current weather of a city",
                {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                ["city", "unit"])
FORECAST = _tool("get_forecast", "Weather forecast for the coming days",
                 {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                 ["city", "days"])
SEARCH = _tool("web_search", "Search the web",
               {"query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
               ["query"])
CALCULATOR = _tool("calculate", "Evaluate one arithmetic operation",
                   {"a": {"type": "number"}, "b": {"type": "number"},
                    "operation": {"type": "string", "enum": ["add", "subtract", "multiply", "divide"]}},
                   ["a", "b", "operation"])
EVENT = _tool("create_event", "Add an event to the calendar",
              {"title": {"type": "string"}, "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
               "start_time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
               "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480},
               "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
              ["title", "date", "start_time"])
LIST_EVENTS = _tool("list_events", "Events of one day", {"date": {"type": "string"}}, ["date"])
EMAIL = _tool("send_email", "Send an email",
              {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
              ["to", "subject", "body"])
CONVERT = _tool("convert_units", "Convert a quantity between units",
                {"value": {"type": "number"}, "from_unit": {"type": "string", "enum": ["km", "mile", "kg", "lb"]},
                 "to_unit": {"type": "string", "enum": ["km", "mile", "kg", "lb"]}},
                ["value", "from_unit", "to_unit"])
REMINDER = _tool("set_reminder", "Remind the user of something later",
                 {"text": {"type": "string"}, "minutes_from_now": {"type": "integer", "minimum": 1}},
                 ["text", "minutes_from_now"])

TASKS = [
    ("What is the weather in Paris right now, in celsius?", [WEATHER, SEARCH]),
    ("Will it rain in Tokyo over the next three days?", [WEATHER, FORECAST, SEARCH]),
    ("What is 1234 multiplied by 56?", [CALCULATOR, SEARCH]),
    ("Find recent news about the James Webb telescope.", [SEARCH, WEATHER]),
    ("Schedule a team meeting on 2026-03-14 at 10:30 for one hour with Ana and Bo.", [EVENT, LIST_EVENTS, EMAIL]),
    ("What is on my calendar for 2026-05-02?", [LIST_EVENTS, EVENT]),
    ("Email bob@example.com that the report is late, subject 'Report'.", [EMAIL, SEARCH, REMINDER]),
    ("How many miles is 42 km?", [CONVERT, CALCULATOR]),
    ("Remind me to call mom in 20 minutes.", [REMINDER, EVENT, EMAIL]),
    ("Is it warm in Lisbon today? Use fahrenheit.", [WEATHER, FORECAST]),
    ("Divide 918 by 17.", [CALCULATOR, CONVERT, SEARCH]),
    ("Search for the best pizza in Naples, five results.", [SEARCH, WEATHER, CALCULATOR]),
    ("Book lunch with Carla on 2026-07-09 at 12:15.", [EVENT, REMINDER]),
    ("Convert 70 kg to pounds.", [CONVERT, SEARCH]),
    ("What is the forecast for Berlin for the next week?", [FORECAST, WEATHER, SEARCH, EVENT]),
    ("Send an email to team@example.com with subject 'Offsite' saying the offsite moved to Friday.",
     [EMAIL, EVENT, REMINDER, SEARCH]),
]
