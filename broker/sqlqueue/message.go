package sqlqueue

import (
	"bytes"
	"encoding/json"

	"github.com/ThreeDotsLabs/watermill/message"
)

// HeaderMetadata is the header that carries a message row's metadata column as it is stored,
// when it is not a JSON object: a row written by a producer other than watermill-sql. The
// message is delivered all the same.
const HeaderMetadata = "sql_metadata"

// newMessage makes the message of a row, as watermill-sql's publisher wrote it: the metadata
// column is a JSON object of strings. It never fails: a value that is not a string becomes its
// JSON text, null becomes "", and a column that is not a JSON object goes whole to
// HeaderMetadata.
func newMessage(uuid string, payload, metadata []byte) *message.Message {
	m := message.NewMessage(uuid, payload)
	if len(bytes.TrimSpace(metadata)) == 0 || bytes.Equal(bytes.TrimSpace(metadata), []byte("null")) {
		return m
	}
	// The usual column, an object of strings, in one pass.
	if json.Unmarshal(metadata, &m.Metadata) == nil {
		return m
	}
	clear(m.Metadata)
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(metadata, &fields); err != nil {
		m.Metadata.Set(HeaderMetadata, string(metadata))
		return m
	}
	for k, raw := range fields {
		var s string // null leaves it empty
		if json.Unmarshal(raw, &s) == nil {
			m.Metadata.Set(k, s)
		} else {
			m.Metadata.Set(k, string(raw))
		}
	}
	return m
}
