"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}), translated
onto the chat path: input items become chat messages, the chat parser's output blocks become output
items, streamed in the official event order; stored responses continue a conversation by
previous_response_id."""
