package nats

import (
	"encoding/json"

	wnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
)

// Unmarshal converts a NATS message to a watermill message, and never fails, so that no
// message is left unacknowledged for its headers. The UUID is the header where watermill-nats's
// publisher writes it (its WatermillUUIDHdr), or the Nats-Msg-Id header of a producer that sets
// only that. The other headers become metadata, except the JetStream publish headers
// (Nats-Msg-Id, Nats-Expected-*); a header with several values becomes a JSON array.
func Unmarshal(m *nats.Msg) *message.Message {
	id := m.Header.Get(wnats.WatermillUUIDHdr)
	if id == "" {
		id = m.Header.Get(nats.MsgIdHdr)
	}
	msg := message.NewMessage(id, m.Data)
	md := msg.Metadata
	for k, vs := range m.Header {
		switch k {
		case wnats.WatermillUUIDHdr, nats.MsgIdHdr, nats.ExpectedLastMsgIdHdr, nats.ExpectedStreamHdr,
			nats.ExpectedLastSubjSeqHdr, nats.ExpectedLastSeqHdr:
			continue
		}
		switch len(vs) {
		case 0:
			md[k] = ""
		case 1:
			md[k] = vs[0]
		default:
			b, _ := json.Marshal(vs)
			md[k] = string(b)
		}
	}
	return msg
}
