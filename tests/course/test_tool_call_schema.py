"""Stage 9's provided tool_call_schema (not an exercise, so not graded): under tool_choice
"required" the tools' parameters move inside the schema the answer is held to, and their
references must move with them. (Stage 11's serving tests run such a request end to end.)"""

from __future__ import annotations

from s09_zmq_serving.tool_calls import ToolChoice, tool_call_schema

BAD = {"type": "function", "function": {"name": "f"}}  # a tool without parameters


def test_a_required_calls_schema_keeps_each_tools_refs_pointing_into_its_parameters():
    """Under "required" each tool's parameters move to items.anyOf[i].properties.arguments of the
    schema the answer is held to: their "$ref"s to their own parts ("#/$defs/...", the layout
    pydantic and the openai client write) move with them, and JSON data that merely looks like a
    reference (a const, an enum, a default, examples) stays as the client wrote it."""
    data = {"$ref": "#/$defs/City"}
    parameters = {
        "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}}}},
        "type": "object",
        "properties": {
            "city": {"$ref": "#/$defs/City"},
            "enum": {"$ref": "#"},  # a property named like a keyword is still a schema
            "note": {"const": data, "enum": [data], "default": data, "examples": [data]},
        },
    }
    tools = [BAD, {"type": "function", "function": {"name": "g", "parameters": parameters}}]
    schema = tool_call_schema(tools, ToolChoice("required"))
    moved = schema["items"]["anyOf"][1]["properties"]["arguments"]
    at = "#/items/anyOf/1/properties/arguments"
    assert moved["properties"]["city"] == {"$ref": f"{at}/$defs/City"}, (
        f"a $ref into the parameters should point to where they now are ({at}): {moved['properties']['city']}"
    )
    assert moved["properties"]["enum"] == {"$ref": at}, f"'#' is the parameters themselves: {moved['properties']}"
    assert moved["properties"]["note"] == parameters["properties"]["note"], f"data is no reference: {moved}"
    assert parameters["properties"]["city"] == {"$ref": "#/$defs/City"}, "the client's tools (the prompt's) are kept"
