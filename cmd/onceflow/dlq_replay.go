package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/spf13/cobra"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/messagedata"
)

// replayed and kept are the entries of a replay report.
type replayed struct {
	ID      string `json:"id"`
	To      string `json:"to"`
	Handler string `json:"handler"`
	Attempt int    `json:"attempt"`
	Reason  string `json:"reason"`
	Replays int    `json:"replays"`
}

type kept struct {
	ID      string `json:"id"`
	Topic   string `json:"topic"`
	Handler string `json:"handler"`
	Reason  string `json:"reason"`
}

// dropped is a dead letter that replay keeps because the dead-letter broker refused its
// payload: replaying it would deliver an empty message in place of the original.
type dropped struct {
	ID      string `json:"id"`
	Handler string `json:"handler"`
	Reason  string `json:"reason"`
	// Dropped is the HeaderDeadLetterPayloadDropped header: how much was dropped, and why.
	Dropped string `json:"dropped"`
}

// replayReport is the JSON document of dlq replay.
type replayReport struct {
	Broker   string     `json:"broker"`
	Topic    string     `json:"topic"`
	Group    string     `json:"group"`
	Replayed []replayed `json:"replayed"`
	Kept     []kept     `json:"kept"`
	// NotFound lists the --id values that matched no dead letter.
	NotFound []string `json:"not_found"`
	// NoTopic lists the selected dead letters left in place because they name no original
	// topic and --to was not given.
	NoTopic []string `json:"no_topic"`
	// PayloadDropped lists the selected dead letters left in place because they carry no
	// payload to replay.
	PayloadDropped []dropped `json:"payload_dropped"`
	// Limited is true when the replay looked at --limit dead letters: more may be waiting.
	Limited bool `json:"limited"`
}

func newDLQReplayCommand() *cobra.Command {
	var f dlqFlags
	var sel selection
	var to string
	cmd := &cobra.Command{
		Use:   "replay",
		Short: "Put dead letters back on the topic they came from",
		Long: `Publishes the chosen dead letters to the topic they were consumed from (their
onceflow_dlq_topic header, or --to), and only once the broker has stored that publish removes
them from the dead-letter topic. The others stay where they are, in their order. Choose them
with exactly one of --id (repeatable; the id dlq list shows, or the original id of a dead
letter that could not carry it), --reason (every dead letter whose reason contains the text,
case-sensitive: a whole reason copied from dlq list is an exact match) or --all.

A dead letter whose payload the dead-letter broker refused (header
onceflow_dlq_payload_dropped) is kept, not replayed: it would reach the handler empty. The
report says so; dlq delete removes it once its message is dealt with otherwise.

A replayed message keeps its original id, payload and headers, so it goes through the handler's
duplicate detection again: a message that was in fact applied is acknowledged without being
applied again, and replaying the same message twice applies it at most once. The dead-letter
headers (onceflow_dlq_*) are removed; onceflow_replay_count counts the replays and
onceflow_replay_time says when the last one was. A crash between the publish and the removal
leaves the dead letter in place as well: it is replayed again next time, and deduplication
absorbs the duplicate. Nothing is lost.

What removal means: RabbitMQ acknowledges the message on the group's queue (other groups'
queues keep their copies); the SQL and SQLite queues delete its row, NATS deletes it from the
stream, Redis acknowledges it for the group and deletes the entry: other consumer groups of the
dead-letter topic no longer see it either. On NATS the replay is published with a Nats-Msg-Id of
its own, so that JetStream does not drop it as a duplicate of the original publish.

The exit status is 1 when an --id or the --reason matched no dead letter, or a chosen dead
letter was kept (it names no topic, or its payload was dropped).`,
		Example: `  onceflow dlq replay --broker sqlite://var/queue.db --id order-17 --id order-18
  onceflow dlq replay --broker "$ONCEFLOW_BROKER" --reason 'account 7 is closed'
  onceflow dlq replay --broker 'nats://127.0.0.1:4222?group=billing' --all
  onceflow dlq replay --broker "$ONCEFLOW_BROKER" --all --to orders.retry --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := sel.check(cmd, "replay"); err != nil {
				return err
			}
			b, err := f.open(cmd.Context())
			if err != nil {
				return err
			}
			defer b.Close()

			now := time.Now().UTC().Format(time.RFC3339Nano)
			rep := replayReport{Broker: b.String(), Topic: f.topic, Group: b.ConsumerGroup(),
				Replayed: []replayed{}, Kept: []kept{}, NotFound: []string{}, NoTopic: []string{}, PayloadDropped: []dropped{}}
			res, moveErr := b.Move(cmd.Context(), f.topic, f.limit, func(m *message.Message) (string, *message.Message) {
				if !sel.matches(m) {
					return "", nil
				}
				if why := m.Metadata.Get(messagedata.HeaderDeadLetterPayloadDropped); why != "" {
					d := describe(m, false)
					rep.PayloadDropped = append(rep.PayloadDropped, dropped{ID: d.ID, Handler: d.Handler, Reason: d.Reason, Dropped: why})
					return "", nil
				}
				dest := to
				if dest == "" {
					dest = m.Metadata.Get(messagedata.HeaderDeadLetterTopic)
				}
				if dest == "" {
					rep.NoTopic = append(rep.NoTopic, m.UUID)
					return "", nil
				}
				return dest, replayMessage(m, now)
			})
			for _, mv := range res.Moved {
				d := describe(mv.Message, false)
				rep.Replayed = append(rep.Replayed, replayed{ID: d.ID, To: mv.To, Handler: d.Handler, Attempt: d.Attempt,
					Reason: d.Reason, Replays: d.Replays + 1})
			}
			for _, m := range res.Kept {
				d := describe(m, false)
				rep.Kept = append(rep.Kept, kept{ID: d.ID, Topic: d.Topic, Handler: d.Handler, Reason: d.Reason})
			}
			rep.NotFound = sel.notFound()
			rep.Limited = len(res.Moved)+len(res.Kept) >= f.limit

			if f.asJSON {
				if err := writeJSON(cmd.OutOrStdout(), rep); err != nil {
					return errors.Join(moveErr, err)
				}
			} else {
				printReplay(cmd.OutOrStdout(), rep)
			}
			var errs []error
			if moveErr != nil {
				errs = append(errs, moveErr)
			}
			if err := sel.missed(f.topic, b.ConsumerGroup()); err != nil {
				errs = append(errs, err)
			}
			if len(rep.NoTopic) > 0 {
				errs = append(errs, fmt.Errorf("dead letters %s name no original topic (header %s): pass --to", strings.Join(quoteAll(rep.NoTopic), ", "), messagedata.HeaderDeadLetterTopic))
			}
			if len(rep.PayloadDropped) > 0 {
				var ids []string
				for _, d := range rep.PayloadDropped {
					ids = append(ids, d.ID)
				}
				errs = append(errs, fmt.Errorf("dead letters %s carry no payload (header %s): kept, not replayed", strings.Join(quoteAll(ids), ", "), messagedata.HeaderDeadLetterPayloadDropped))
			}
			return errors.Join(errs...)
		},
	}
	f.register(cmd, defaultReplayLimit, "look at most at this many dead letters, oldest first")
	sel.register(cmd, "replay")
	cmd.Flags().StringVar(&to, "to", "", "publish to this topic instead of the one each dead letter came from")
	return cmd
}

// replayMessage returns the message that replays dead letter m: its id (the original one, when
// the dead-letter broker could not carry it and the dead letter kept it in a header), payload
// and headers, without the dead-letter headers, with the replay count and time.
func replayMessage(m *message.Message, now string) *message.Message {
	id := m.UUID
	if orig := m.Metadata.Get(messagedata.HeaderDeadLetterOriginalID); orig != "" {
		id = orig
	}
	out := message.NewMessage(id, m.Payload)
	for k, v := range m.Metadata {
		out.Metadata[k] = v
	}
	for _, h := range deadLetterHeaders {
		delete(out.Metadata, h)
	}
	// Properties of the delivery the dead letter was read from, not of the message.
	delete(out.Metadata, broker.HeaderAMQPRedelivered)
	n, _ := strconv.Atoi(m.Metadata.Get(messagedata.HeaderReplayCount))
	out.Metadata[messagedata.HeaderReplayCount] = strconv.Itoa(n + 1)
	out.Metadata[messagedata.HeaderReplayTime] = now
	return out
}

// printReplay writes the readable form of a replay report.
func printReplay(w io.Writer, rep replayReport) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, r := range rep.Replayed {
		fmt.Fprintf(tw, "replayed\t%s\t-> %s\thandler %s, attempt %d: %s\n", cell(r.ID, 0), cell(r.To, 0), cell(r.Handler, 0), r.Attempt, cell(r.Reason, tableReasonWidth))
	}
	for _, k := range rep.Kept {
		fmt.Fprintf(tw, "kept\t%s\t   %s\thandler %s: %s\n", cell(k.ID, 0), cell(k.Topic, 0), cell(k.Handler, 0), cell(k.Reason, tableReasonWidth))
	}
	tw.Flush()
	more := ""
	if rep.Limited {
		more = " (the first --limit; more may be waiting)"
	}
	fmt.Fprintf(w, "replayed %s, kept %d %s%s\n",
		plural(len(rep.Replayed), "dead letter"), len(rep.Kept), where(rep.Topic, rep.Group, rep.Broker), more)
	for _, id := range rep.NotFound {
		fmt.Fprintf(w, "not found: %s\n", printable(id))
	}
	for _, id := range rep.NoTopic {
		fmt.Fprintf(w, "no original topic: %s (pass --to)\n", printable(id))
	}
	for _, d := range rep.PayloadDropped {
		fmt.Fprintf(w, "payload dropped, not replayed: %s: %s\n", printable(d.ID), printable(d.Dropped))
	}
}
