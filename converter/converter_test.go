package converter_test

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/converter"
	"github.com/onceflow/onceflow/messagedata"
)

func TestFromMessage_IDPolicyOrder(t *testing.T) {
	c := converter.New(converter.Config{IDHeader: "x-id"})
	tests := []struct {
		name     string
		uuid     string
		metadata message.Metadata
		want     string
	}{
		{"watermill uuid first", "wm-1", message.Metadata{"x-id": "hdr-1", messagedata.HeaderAMQPMessageID: "amqp-1"}, "wm-1"},
		{"configured header second", "", message.Metadata{"x-id": "hdr-1", messagedata.HeaderAMQPMessageID: "amqp-1"}, "hdr-1"},
		{"AMQP message_id last", "", message.Metadata{messagedata.HeaderAMQPMessageID: "amqp-1"}, "amqp-1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := message.NewMessage(tt.uuid, []byte("p"))
			m.Metadata = tt.metadata
			md, err := c.FromMessage("orders", m)
			require.NoError(t, err)
			require.Equal(t, tt.want, md.ID)
			require.Equal(t, "orders", md.Topic)
			require.Equal(t, 1, md.Attempt)
		})
	}
}

func TestFromMessage_NoUsableIDNamesWhatItLookedAt(t *testing.T) {
	md, err := converter.New(converter.Config{}).FromMessage("orders", message.NewMessage("", []byte("p")))
	require.ErrorIs(t, err, messagedata.ErrNoMessageID)
	require.EqualError(t, err, `message has no id (watermill uuid, header "onceflow_id" and AMQP message_id are empty)`)
	require.Equal(t, "p", string(md.Payload), "what could be read is returned for the dead letter")
}

func TestFromMessage_NoUsableIDNamesTheFieldsOfTheBrokerAtHand(t *testing.T) {
	for system, want := range map[string]string{
		"rabbitmq": `header _watermill_message_uuid, header "x-id" and AMQP message_id are empty`,
		"nats":     `header _watermill_message_uuid, header Nats-Msg-Id and header "x-id" are empty`,
		"kafka":    `record header _watermill_message_uuid and record header "x-id" are empty`,
		"redis":    `stream field _watermill_message_uuid and header "x-id" are empty`,
		"sqlite":   `column uuid and header "x-id" are empty`,
	} {
		_, err := converter.New(converter.Config{IDHeader: "x-id", System: system}).FromMessage("orders", message.NewMessage("", nil))
		require.ErrorIs(t, err, messagedata.ErrNoMessageID)
		require.EqualError(t, err, "message has no id ("+want+")", system)
		if system != "rabbitmq" {
			require.NotContains(t, err.Error(), "AMQP", system)
		}
	}
}

func TestFromMessage_ReadsTimestampKeyAndSequence(t *testing.T) {
	m := message.NewMessage("m-1", nil)
	m.Metadata.Set(messagedata.HeaderTimestamp, "2026-11-29T10:00:00.123456789Z")
	m.Metadata.Set(messagedata.HeaderKey, "account-7")
	m.Metadata.Set(messagedata.HeaderSequence, "42")
	md, err := converter.New(converter.Config{}).FromMessage("t", m)
	require.NoError(t, err)
	require.Equal(t, time.Date(2026, 11, 29, 10, 0, 0, 123456789, time.UTC), md.Timestamp)
	require.Equal(t, "account-7", md.Key)
	require.Equal(t, uint64(42), md.Sequence)
}

func TestFromMessage_MalformedSequenceIsAnError(t *testing.T) {
	m := message.NewMessage("m-1", nil)
	m.Metadata.Set(messagedata.HeaderSequence, "-3")
	_, err := converter.New(converter.Config{}).FromMessage("t", m)
	require.ErrorContains(t, err, messagedata.HeaderSequence)
	require.ErrorContains(t, err, "-3")
}

// A foreign producer's timestamp in epoch seconds or milliseconds, or ISO 8601 without a zone,
// is read (as UTC); one that is no time at all makes a message without a timestamp, not an
// error, and is logged once per Converter.
func TestFromMessage_TimestampsOfForeignProducers(t *testing.T) {
	var logs bytes.Buffer
	c := converter.New(converter.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	want := time.Date(2026, 12, 6, 10, 11, 12, 0, time.UTC)
	for _, v := range []string{"1796551872", "1796551872000", "2026-12-06T10:11:12", "2026-12-06T10:11:12Z"} {
		m := message.NewMessage("m-1", nil)
		m.Metadata.Set(messagedata.HeaderTimestamp, v)
		md, err := c.FromMessage("t", m)
		require.NoError(t, err, v)
		require.True(t, want.Equal(md.Timestamp), "%s: %s", v, md.Timestamp)
	}
	require.Empty(t, logs.String())

	for _, id := range []string{"m-2", "m-3"} {
		m := message.NewMessage(id, []byte("p"))
		m.Metadata.Set(messagedata.HeaderTimestamp, "yesterday")
		md, err := c.FromMessage("t", m)
		require.NoError(t, err)
		require.True(t, md.Timestamp.IsZero())
		require.Equal(t, id, md.ID)
		require.Equal(t, "yesterday", md.Header(messagedata.HeaderTimestamp), "the header stays as it came")
	}
	require.Equal(t, 1, strings.Count(logs.String(), "level=WARN"), logs.String())
	require.Contains(t, logs.String(), `message_id=m-2`)
	require.Contains(t, logs.String(), `holds \"yesterday\"`)
}

func TestToMessage_RoundTrip(t *testing.T) {
	md := &messagedata.MessageData{
		ID: "m-1", Timestamp: time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC), Key: "k", Sequence: 9,
		Headers: map[string]string{"a": "b"}, Payload: []byte("p"),
	}
	back, err := converter.New(converter.Config{}).FromMessage("t", converter.ToMessage(md))
	require.NoError(t, err)
	require.Equal(t, md.ID, back.ID)
	require.Equal(t, md.Timestamp, back.Timestamp)
	require.Equal(t, md.Key, back.Key)
	require.Equal(t, md.Sequence, back.Sequence)
	require.Equal(t, "b", back.Header("a"))
	require.Equal(t, md.Payload, back.Payload)
}

func TestFromMessage_IDFunctionTakesThePlaceOfThePolicy(t *testing.T) {
	c := converter.New(converter.Config{ID: converter.JSONField("order.id")})
	m := message.NewMessage("random-uuid-of-this-send", []byte(`{"order": {"id": "ord-7", "total": 3}}`))
	md, err := c.FromMessage("orders", m)
	require.NoError(t, err)
	require.Equal(t, "ord-7", md.ID, "the business key, not the watermill uuid")

	md, err = c.FromMessage("orders", message.NewMessage("", []byte(`{"order": {"id": 42}}`)))
	require.NoError(t, err)
	require.Equal(t, "42", md.ID, "a number is its JSON text")

	md, err = converter.New(converter.Config{ID: converter.Header("x-key")}).FromMessage("orders", message.NewMessage("u", nil))
	require.ErrorIs(t, err, messagedata.ErrNoMessageID)
	require.ErrorContains(t, err, "the handler's id function found none")
	require.Equal(t, "orders", md.Topic, "what could be read is returned with the error")
}

func TestJSONField_ErrorsNameThePath(t *testing.T) {
	id := converter.JSONField("order.id")
	for payload, want := range map[string]string{
		`not json`:                `id field "order.id": payload is not JSON`,
		`{"order": "x"}`:          `id field "order.id": no object holds "id"`,
		`{"other": {}}`:           `id field "order.id": "order" is missing`,
		`{"order": {"id": null}}`: `id field "order.id" holds <nil>, not a string or a number`,
		`{"order": {"id": [1]}}`:  `id field "order.id" holds []interface {}, not a string or a number`,
	} {
		_, err := id(message.NewMessage("", []byte(payload)))
		require.ErrorContains(t, err, want, payload)
	}
}
