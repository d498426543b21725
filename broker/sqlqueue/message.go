package sqlqueue

import (
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow/internal/queuetable"
)

// HeaderMetadata is the header that carries a message row's metadata column as it is stored,
// when it is not a JSON object: a row written by a producer other than watermill-sql. The
// message is delivered all the same.
const HeaderMetadata = "sql_metadata"

// newMessage makes the message of a row as queuetable.NewMessage does, and never fails
// (HeaderMetadata).
func newMessage(uuid string, payload, metadata []byte) *message.Message {
	m, err := queuetable.NewMessage(uuid, payload, metadata)
	if err != nil {
		m.Metadata.Set(HeaderMetadata, string(metadata))
	}
	return m
}
