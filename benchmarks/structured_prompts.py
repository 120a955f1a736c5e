"""Sixteen JSON-extraction tasks for ``bench_structured.py``: a short text and the schema to fill from it.

Schemas come in several shapes: flat records, nested objects, enums, arrays of strings, arrays of
objects, numbers and booleans. Each prompt asks for the JSON in words too, so the same prompts
work without a grammar (the "no grammar" baseline).
"""

from __future__ import annotations

import json

_PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "occupation": {"type": "string"}}, "required": ["name", "age", "city", "occupation"]}
_ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                             "postal_code": {"type": "string"}, "country": {"type": "string"}},
            "required": ["street", "city", "postal_code", "country"]}
_SENTIMENT = {"type": "object", "properties": {
    "sentiment": {"enum": ["positive", "negative", "neutral"]}, "product": {"type": "string"},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["sentiment", "product", "rating"]}
_MEETING = {"type": "object", "properties": {
    "title": {"type": "string"}, "date": {"type": "string"}, "time": {"type": "string"},
    "attendees": {"type": "array", "items": {"type": "string"}},
    "location": {"type": "object", "properties": {"building": {"type": "string"}, "room": {"type": "string"}},
                 "required": ["building", "room"]}},
    "required": ["title", "date", "time", "attendees", "location"]}
_ORDER = {"type": "object", "properties": {
    "order_id": {"type": "string"}, "customer": {"type": "string"},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "product": {"type": "string"}, "quantity": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["product", "quantity", "price"]}},
    "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]}},
    "required": ["order_id", "customer", "items", "status"]}
_RECIPE = {"type": "object", "properties": {
    "dish": {"type": "string"}, "servings": {"type": "integer"},
    "ingredients": {"type": "array", "items": {"type": "string"}},
    "difficulty": {"enum": ["easy", "medium", "hard"]}}, "required": ["dish", "servings", "ingredients", "difficulty"]}
_BOOK = {"type": "object", "properties": {
    "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
    "genres": {"type": "array", "items": {"type": "string"}}, "in_stock": {"type": "boolean"}},
    "required": ["title", "author", "year", "genres", "in_stock"]}
_TICKET = {"type": "object", "properties": {
    "category": {"enum": ["billing", "technical", "account", "other"]},
    "priority": {"enum": ["low", "medium", "high", "urgent"]}, "summary": {"type": "string"},
    "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                 "required": ["name", "email"]}},
    "required": ["category", "priority", "summary", "customer"]}
_EMPLOYEE = {"type": "object", "properties": {
    "employee": {"type": "object", "properties": {"name": {"type": "string"}, "title": {"type": "string"},
                                                  "department": {"type": "string"}},
                 "required": ["name", "title", "department"]},
    "address": _ADDRESS, "skills": {"type": "array", "items": {"type": "string"}}},
    "required": ["employee", "address", "skills"]}
_FLIGHT = {"type": "object", "properties": {
    "airline": {"type": "string"}, "flight_number": {"type": "string"},
    "departure": {"type": "object", "properties": {"airport": {"type": "string"}, "time": {"type": "string"}},
                  "required": ["airport", "time"]},
    "arrival": {"type": "object", "properties": {"airport": {"type": "string"}, "time": {"type": "string"}},
                "required": ["airport", "time"]},
    "seat_class": {"enum": ["economy", "premium", "business", "first"]}},
    "required": ["airline", "flight_number", "departure", "arrival", "seat_class"]}
_WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "temperature_c": {"type": "number"},
    "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy", "windy"]},
    "forecast": {"type": "array", "items": {"type": "object", "properties": {
        "day": {"type": "string"}, "high_c": {"type": "number"}, "low_c": {"type": "number"}},
        "required": ["day", "high_c", "low_c"]}}},
    "required": ["city", "temperature_c", "condition", "forecast"]}
_COMPANY = {"type": "object", "properties": {
    "company": {"type": "string"}, "founded": {"type": "integer"}, "headquarters": {"type": "string"},
    "employees": {"type": "integer"}, "products": {"type": "array", "items": {"type": "string"}}},
    "required": ["company", "founded", "headquarters", "employees", "products"]}
_MOVIE = {"type": "object", "properties": {
    "title": {"type": "string"}, "director": {"type": "string"}, "year": {"type": "integer"},
    "cast": {"type": "array", "items": {"type": "object", "properties": {
        "actor": {"type": "string"}, "role": {"type": "string"}}, "required": ["actor", "role"]}},
    "rating": {"enum": ["G", "PG", "PG-13", "R"]}},
    "required": ["title", "director", "year", "cast", "rating"]}
_INVOICE = {"type": "object", "properties": {
    "invoice_number": {"type": "string"}, "vendor": _ADDRESS | {"properties": {**_ADDRESS["properties"],
                                                                              "name": {"type": "string"}},
                                                               "required": ["name", *_ADDRESS["required"]]},
    "total": {"type": "number"}, "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]}, "paid": {"type": "boolean"}},
    "required": ["invoice_number", "vendor", "total", "currency", "paid"]}
_EVENT = {"type": "object", "properties": {
    "event": {"type": "string"}, "kind": {"enum": ["concert", "conference", "sports", "festival"]},
    "venue": {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "capacity": {"type": "integer"}},
              "required": ["name", "city", "capacity"]},
    "tickets": {"type": "array", "items": {"type": "object", "properties": {
        "tier": {"type": "string"}, "price": {"type": "number"}}, "required": ["tier", "price"]}}},
    "required": ["event", "kind", "venue", "tickets"]}
_PATIENT = {"type": "object", "properties": {
    "patient": {"type": "string"}, "age": {"type": "integer"},
    "symptoms": {"type": "array", "items": {"type": "string"}},
    "triage": {"enum": ["green", "yellow", "orange", "red"]}, "allergies": {"type": "array", "items": {"type": "string"}}},
    "required": ["patient", "age", "symptoms", "triage", "allergies"]}

TASKS: list[tuple[str, dict]] = [
    ("Maria Gonzalez is a 34-year-old software engineer who lives in Barcelona.", _PERSON),
    ("Please send the package to 221B Baker Street, London, NW1 6XE, United Kingdom.", _ADDRESS),
    ("I bought the AeroPress coffee maker last month. It broke after two weeks and support never answered. "
     "One star.", _SENTIMENT),
    ("Quarterly planning review on March 14 at 10:30 with Alice Chen, Bob Martin and Priya Patel, in the "
     "North Tower, room 4B.", _MEETING),
    ("Order A-10293 for Jonas Weber: 2 USB-C cables at 9.99 each and 1 laptop stand at 39.50. The order "
     "has shipped.", _ORDER),
    ("Classic pancakes for four people: flour, milk, two eggs, butter, sugar and a pinch of salt. Anyone "
     "can make them.", _RECIPE),
    ("'The Left Hand of Darkness' by Ursula K. Le Guin, published in 1969, is science fiction and feminist "
     "fiction. We have three copies on the shelf.", _BOOK),
    ("Hi, this is Tom Baker (tom.baker@example.com). I was charged twice for my subscription this month and "
     "need a refund today, it is urgent.", _TICKET),
    ("Dr. Aisha Rahman, head of data science in the research department, works at 500 Market Street, San "
     "Francisco, 94105, USA. She knows Python, statistics and causal inference.", _EMPLOYEE),
    ("Lufthansa flight LH 454 leaves Frankfurt (FRA) at 13:20 and lands in San Francisco (SFO) at 15:55. "
     "Seat 4A is in business class.", _FLIGHT),
    ("Oslo is at 3 degrees and snowing. Tomorrow (Tuesday) a high of 1 and a low of -4; Wednesday a high "
     "of 2 and a low of -3.", _WEATHER),
    ("Nordic Robotics was founded in 2011, is based in Gothenburg and has 420 employees. It sells the "
     "Picker X2 arm, the Rover cart and the FleetView software.", _COMPANY),
    ("'Arrival' (2016), directed by Denis Villeneuve, stars Amy Adams as Louise Banks and Jeremy Renner as "
     "Ian Donnelly. It is rated PG-13.", _MOVIE),
    ("Invoice INV-2024-0387 from Acme Supplies, 12 Industrial Way, Leeds, LS1 4AP, UK: 1,250.00 EUR, "
     "already paid.", _INVOICE),
    ("Jazz on the Lake is a music festival at Lakeside Park in Geneva (capacity 8000). Day passes cost 45 "
     "and weekend passes 80.", _EVENT),
    ("Patient Lena Novak, 58, arrives with chest pain and shortness of breath. She is allergic to "
     "penicillin. Triage level: red.", _PATIENT),
]


def conversation(text: str, schema: dict) -> list[dict]:
    """The chat messages of one task."""
    return [{"role": "system", "content": "You extract facts from text and answer with JSON only."},
            {"role": "user", "content": f"Text: {text}\n\nReturn a JSON object with this JSON schema:\n"
                                        f"{json.dumps(schema)}"}]
