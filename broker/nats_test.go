package broker_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
)

func TestNATS_RepublishOfTheSameUUIDIsDroppedWithinTheDuplicateWindow(t *testing.T) {
	t.Parallel()
	f := setup(t, scheme{name: "nats", url: testsvc.NATSURL, cleanup: removeTopic}, testTimings)
	b := f.open(broker.Options{})
	f.publish(b, f.message(1))
	f.publish(b, f.message(1)) // a publisher retrying after a lost JetStream ack
	require.Equal(t, []string{f.message(1).UUID}, uuids(peek(t, b, f.topic, 10)))
}

func TestNATS_HeaderNATSMsgIDReplacesTheUUIDAsNatsMsgID(t *testing.T) {
	t.Parallel()
	f := setup(t, scheme{name: "nats", url: testsvc.NATSURL, cleanup: removeTopic}, testTimings)
	b := f.open(broker.Options{})
	f.publish(b, f.message(1))
	again := f.message(1)
	again.Metadata.Set(broker.HeaderNATSMsgID, "replay-1")
	f.publish(b, again)
	f.publish(b, again) // the same Nats-Msg-Id: dropped

	got := peek(t, b, f.topic, 10)
	require.Equal(t, []string{f.message(1).UUID, f.message(1).UUID}, uuids(got), "the same UUID under another Nats-Msg-Id is stored")
	for _, m := range got {
		requireSame(t, f.message(1), m)
		_, has := m.Metadata[broker.HeaderNATSMsgID]
		require.False(t, has, "%s is not sent as a header", broker.HeaderNATSMsgID)
	}
}

func TestNATS_MessageDeadLetteredTwiceWithinTheDuplicateWindowIsKeptTwice(t *testing.T) {
	t.Parallel()
	f := setup(t, scheme{name: "nats", url: testsvc.NATSURL, cleanup: removeTopic}, testTimings)
	b := f.open(broker.Options{})
	deadLetter := func(at string) *message.Message {
		m := f.message(1)
		m.Metadata.Set(messagedata.HeaderDeadLetterHandler, "billing")
		m.Metadata.Set(messagedata.HeaderDeadLetterTime, at)
		return m
	}
	// Dead-lettered, replayed, dead-lettered again: both dead letters are kept. A retried
	// publish of one dead letter is still dropped.
	f.publish(b, deadLetter("2026-01-01T00:00:00Z"), deadLetter("2026-01-01T00:00:00Z"), deadLetter("2026-01-01T00:00:05Z"))
	got := peek(t, b, f.topic, 10)
	require.Equal(t, []string{f.message(1).UUID, f.message(1).UUID}, uuids(got))
	require.Equal(t, "2026-01-01T00:00:05Z", got[1].Metadata.Get(messagedata.HeaderDeadLetterTime))
}
