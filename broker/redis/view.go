package redis

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/broker"
)

// view reads a topic's stream with XPENDING and XRANGE: the group's pending entries (read
// by a consumer of the group, not acknowledged), then the entries past the group's
// last-delivered id; the whole stream before the group exists. It reads nothing with
// XREADGROUP, so no entry changes hands. Remove acknowledges the entry for the group (XACK) and
// deletes it from the stream (XDEL).
type view struct {
	client   *redis.Client
	group    string
	topic    string
	hasGroup bool   // the group exists
	last     string // the group's last-delivered id; 0-0, before every entry, without a group
}

// newView opens views of the streams of topics. A topic without its stream is an error
// wrapping broker.ErrNotFound; a group that the stream does not have reads the whole stream,
// as it will when it is created.
func newView(client *redis.Client, group string) func(context.Context, string) (broker.View, error) {
	return func(ctx context.Context, topic string) (broker.View, error) {
		v := &view{client: client, group: group, topic: topic, last: "0-0"}
		n, err := client.Exists(ctx, topic).Result()
		if err != nil {
			return nil, fmt.Errorf("look up stream %q: %w", topic, err)
		}
		if n == 0 {
			return nil, fmt.Errorf("%w (no stream)", broker.NotFound("topic", topic))
		}
		groups, err := client.XInfoGroups(ctx, topic).Result()
		if err != nil {
			return nil, fmt.Errorf("look up the consumer groups of stream %q: %w", topic, err)
		}
		for _, g := range groups {
			if g.Name == group {
				v.hasGroup, v.last = true, g.LastDeliveredID
			}
		}
		return v, nil
	}
}

func (v *view) List(ctx context.Context, limit int) ([]broker.Entry, error) {
	// Pending entries all come before the last-delivered id, new ones after it.
	var msgs []redis.XMessage
	if v.hasGroup {
		pending, err := v.client.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: v.topic, Group: v.group, Start: "-", End: "+", Count: int64(limit),
		}).Result()
		if err != nil {
			return nil, fmt.Errorf("read the pending entries of group %q on stream %q: %w", v.group, v.topic, err)
		}
		for _, p := range pending {
			got, err := v.client.XRange(ctx, v.topic, p.ID, p.ID).Result()
			if err != nil {
				return nil, fmt.Errorf("read entry %s of stream %q: %w", p.ID, v.topic, err)
			}
			msgs = append(msgs, got...) // none for an entry deleted while pending
		}
	}
	if len(msgs) < limit {
		newer, err := v.client.XRangeN(ctx, v.topic, "("+v.last, "+", int64(limit-len(msgs))).Result()
		if err != nil {
			return nil, fmt.Errorf("read stream %q: %w", v.topic, err)
		}
		msgs = append(msgs, newer...)
	}
	out := make([]broker.Entry, len(msgs))
	for i, m := range msgs {
		msg, _ := Marshaller{}.Unmarshal(m.Values) // never fails
		out[i] = broker.Entry{Message: msg, Pos: m.ID}
	}
	return out, nil
}

func (v *view) Remove(ctx context.Context, e broker.Entry) error {
	id := e.Pos.(string)
	if v.hasGroup {
		if err := v.client.XAck(ctx, v.topic, v.group, id).Err(); err != nil {
			return fmt.Errorf("XACK entry %s of stream %q: %w", id, v.topic, err)
		}
	}
	if err := v.client.XDel(ctx, v.topic, id).Err(); err != nil {
		return fmt.Errorf("XDEL entry %s of stream %q: %w", id, v.topic, err)
	}
	return nil
}

func (v *view) Close() error { return nil }
